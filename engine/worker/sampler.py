"""Sampling: logits of the last position of each request to one token id (worker, stage 6).

Rows with a `logit_bias` add it first, then rows with a penalty apply it, as vLLM V1 does
(`vllm/v1/sample/ops/penalties.py`): repetition over prompt and output tokens, frequency and
presence over output tokens. Greedy rows take the argmax. Random rows apply temperature, top-k
and top-p, then draw with the exponential-race trick (argmax of p / Exp(1) noise), one noise row
per request: a request with a seed draws its noise from its own generator, so it gets the same
tokens whatever the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stepscope.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Row i: [sampled, top-1 .. top-N] ids and logprobs, for rows that asked for logprobs.
    logprob_token_ids: dict[int, list[int]]
    logprobs: dict[int, list[float]]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask, in place, everything outside each row's top-k and top-p nucleus."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass strictly before it is below top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    logits.scatter_(-1, sorted_idx, sorted_logits.masked_fill(drop, float("-inf")))


def _apply_logit_bias(scores: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
    """Add each of these rows' `logit_bias` to its scores, in place."""
    for i in rows:
        bias = params[i].logit_bias
        ids = torch.tensor(list(bias), device=scores.device)
        scores[i, ids] += torch.tensor(
            list(bias.values()), dtype=scores.dtype, device=scores.device
        )


def _uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _padded(seqs: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged token ids as one [len(seqs), longest] int64 tensor, padded with `pad`."""
    out = np.full((len(seqs), max(map(len, seqs), default=0)), pad, dtype=np.int64)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = seq
    return torch.from_numpy(out).to(device)


def _token_counts(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per row, how often each token id occurs: [rows, vocab]; id `vocab` is padding, dropped."""
    counts = torch.zeros(token_ids.shape[0], vocab + 1, dtype=torch.long, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab] float32, changed in place
    prompt_token_ids: torch.Tensor,  # [rows, longest prompt] int64, padded with vocab
    output_token_ids: torch.Tensor,  # [rows, longest output] int64, padded with vocab
    presence_penalties: torch.Tensor,  # [rows]
    frequency_penalties: torch.Tensor,  # [rows]
    repetition_penalties: torch.Tensor,  # [rows]
) -> None:
    """vLLM's `apply_penalties`: a token seen in the prompt or output has a positive logit
    divided by the repetition penalty and a non-positive one multiplied by it; then each output
    token's count times the frequency penalty, and its presence times the presence penalty, is
    subtracted."""
    vocab = logits.shape[1]
    output_counts = _token_counts(output_token_ids, vocab)
    output_mask = output_counts > 0
    seen = (_token_counts(prompt_token_ids, vocab) > 0) | output_mask
    penalty = torch.where(seen, repetition_penalties[:, None], 1.0)
    logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    logits -= frequency_penalties[:, None] * output_counts
    logits -= presence_penalties[:, None] * output_mask


def _apply_penalties(
    scores: torch.Tensor,  # [num_rows, vocab]
    params: list[SamplingParams],
    rows: list[int],
    all_token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
) -> None:
    """Apply these rows' penalties to their scores, in place."""
    dev = scores.device
    vocab = scores.shape[1]
    idx = torch.tensor(rows, device=dev)
    sub = scores[idx]
    apply_penalties(
        sub,
        _padded([all_token_ids[i][: num_prompt_tokens[i]] for i in rows], vocab, dev),
        _padded([all_token_ids[i][num_prompt_tokens[i] :] for i in rows], vocab, dev),
        torch.tensor([params[i].presence_penalty for i in rows], dtype=sub.dtype, device=dev),
        torch.tensor([params[i].frequency_penalty for i in rows], dtype=sub.dtype, device=dev),
        torch.tensor([params[i].repetition_penalty for i in rows], dtype=sub.dtype, device=dev),
    )
    scores[idx] = sub


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        all_token_ids: Sequence[Sequence[int]],  # per row: prompt, then the output so far
        num_prompt_tokens: Sequence[int],  # per row: how many of all_token_ids are the prompt
    ) -> SamplerOutput:
        # Logit bias and penalties change a copy: logprobs are still the model's own.
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        penalty_rows = [i for i, p in enumerate(params) if _uses_penalties(p)]
        scores = logits.clone() if bias_rows or penalty_rows else logits
        if bias_rows:
            _apply_logit_bias(scores, params, bias_rows)
        if penalty_rows:
            _apply_penalties(scores, params, penalty_rows, all_token_ids, num_prompt_tokens)
        token_ids = scores.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub = (
                scores[rows]
                / torch.tensor([params[i].temperature for i in random_rows], device=logits.device)[
                    :, None
                ]
            )
            top_k = torch.tensor([params[i].top_k for i in random_rows], device=logits.device)
            top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
            if bool((top_k > 0).any()) or bool((top_p < 1).any()):
                _apply_top_k_top_p(sub, top_k, top_p)
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j].exponential_(generator=generators[i] or self.default_generator)
            token_ids[rows] = (probs / noise).argmax(dim=-1)
        ids = token_ids.tolist()
        lp_ids: dict[int, list[int]] = {}
        lps: dict[int, list[float]] = {}
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            logprobs = logits[want].log_softmax(dim=-1)
            top_n = max(params[i].logprobs for i in want)
            top_vals, top_idx = logprobs.topk(max(top_n, 1), dim=-1)
            for j, i in enumerate(want):
                n = params[i].logprobs
                lp_ids[i] = [ids[i]] + top_idx[j, :n].tolist()
                lps[i] = [logprobs[j, ids[i]].item()] + top_vals[j, :n].tolist()
        return SamplerOutput(ids, lp_ids, lps)
