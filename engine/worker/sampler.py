"""Sampling: logits of the last position of each request to one token id (worker, stage 6).

Rows with a `logit_bias` add it first. Greedy rows take the argmax. Random rows apply
temperature, top-k and top-p, then draw with the exponential-race trick (argmax of p / Exp(1)
noise), one noise row per request: a request with a seed draws its noise from its own generator,
so it gets the same tokens whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The logits to choose from: a copy with each row's `logit_bias` added, or the logits
    themselves when no row has one. Logprobs are still reported from the model's own logits."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    scores = logits.clone()
    for i in rows:
        bias = params[i].logit_bias
        ids = torch.tensor(list(bias), device=logits.device)
        scores[i, ids] += torch.tensor(
            list(bias.values()), dtype=logits.dtype, device=logits.device
        )
    return scores


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
    ) -> SamplerOutput:
        scores = _apply_logit_bias(logits, params)
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
