"""Sampling: logits of the last position of each request to one token id (worker, stage 6).

Rows with a `logit_bias` add it first, then rows with a penalty apply it, as vLLM V1 does
(`vllm/v1/sample/ops/penalties.py`): repetition over prompt and output tokens, frequency and
presence over output tokens. Greedy rows take the argmax. Random rows apply temperature, then
top-k and top-p without sorting the vocabulary, keeping the tokens the sorted reference
(`apply_top_k_top_p_sorted`) keeps (vLLM avoids the full sort too,
`vllm/v1/sample/ops/topk_topp_sampler.py`). On the CPU kernels' backend one C call does it for
the batch (kernels/cpu/sampling.c: a few vectorized passes find a threshold that holds every
kept token, and only the tokens above it are sorted); elsewhere a partial top-K of each row
(K from 64, grown only for a row whose nucleus is wider) finds them in torch. The draw inverts
each row's cumulative distribution over its kept tokens at one uniform: a request with a seed
takes its uniform from its own generator, so it gets the same tokens whatever the batch; the
other rows share one call of the engine's generator per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stepscope.engine.sampling_params import SamplingParams
from stepscope.kernels.cpu import ops as cpu_ops


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Row i: [sampled, top-1 .. top-N] ids and logprobs, for rows that asked for logprobs.
    logprob_token_ids: dict[int, list[int]]
    logprobs: dict[int, list[float]]


def apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> None:
    """The reference semantics, by a full sort: mask, in place, everything outside each row's
    top-k, then outside its top-p nucleus (over the top-k, renormalized): a token stays while
    the mass strictly before it is below top_p; the top token always stays."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 is off: a float32 sum can reach 1 before the tail, which must not be cut.
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    logits.scatter_(-1, sorted_idx, sorted_logits.masked_fill(drop, float("-inf")))


FIRST_CANDIDATES = 64  # a partial top-K this wide holds the nucleus of most rows of a real model
GROWTH = 4  # K for the rows whose nucleus reaches past it: 64, 256, 1024, ...


def top_k_top_p_candidates(
    logits: torch.Tensor,  # [rows, vocab], temperature applied
    top_k: torch.Tensor,  # [rows] int, 0: off
    top_p: torch.Tensor,  # [rows] float, 1: off
) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, K] logits (-inf where dropped), token ids
    """The tokens top-k and top-p keep, as `apply_top_k_top_p_sorted` keeps them, from a partial
    top-K of each row instead of a sort; a row whose nucleus reaches past K is looked at again
    with a K `GROWTH` times wider (alone: the others keep their narrow K)."""
    vocab = logits.shape[-1]
    k_req = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    # top-p's mass is over the top-k tokens (renormalized), or over the whole vocabulary: the
    # normalizer of the whole vocabulary only for the rows without top-k that use top-p.
    whole = (top_k == 0) & (top_p < 1)
    if bool(whole.all()):  # the common case: no row copied out of the batch
        full_lse = logits.logsumexp(dim=-1)
    else:
        full_lse = torch.zeros(logits.shape[0], device=logits.device)
        if bool(whole.any()):
            full_lse[whole] = logits[whole].logsumexp(dim=-1)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # rows, values, ids
    rows = torch.arange(logits.shape[0], device=logits.device)
    widest_k = int(k_req[top_k > 0].max()) if bool((top_k > 0).any()) else 0
    k = min(vocab, max(FIRST_CANDIDATES, widest_k))
    while rows.numel():
        batch = logits if rows.numel() == logits.shape[0] else logits[rows]
        values, ids = batch.topk(k, dim=-1)  # sorted, largest first
        drop = torch.arange(k, device=logits.device)[None, :] >= k_req[rows, None]
        masked = values.masked_fill(drop, float("-inf"))
        lse = torch.where(top_k[rows] > 0, masked.logsumexp(dim=-1), full_lse[rows])
        probs = (masked - lse[:, None]).exp()
        mass = probs.cumsum(dim=-1)
        # Done when the first token left out (rank k) would be dropped anyway.
        done = (k_req[rows] <= k) | ((mass[:, -1] >= top_p[rows]) & (top_p[rows] < 1))
        done |= k == vocab
        drop |= ((mass - probs) >= top_p[rows, None]) & (top_p[rows, None] < 1)
        drop[:, 0] = False
        parts.append((rows[done], values[done].masked_fill(drop[done], float("-inf")), ids[done]))
        rows, k = rows[~done], min(vocab, k * GROWTH)
    width = max(v.shape[1] for _, v, _ in parts)
    out_values = logits.new_full((logits.shape[0], width), float("-inf"))
    out_ids = torch.zeros(logits.shape[0], width, dtype=torch.long, device=logits.device)
    for r, v, i in parts:
        out_values[r, : v.shape[1]] = v
        out_ids[r, : i.shape[1]] = i
    return out_values, out_ids


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [rows, vocab], changed in place
    bitmask: torch.Tensor,  # [masked rows, words] int32: bit j of word w allows token 32 w + j
    rows: torch.Tensor,  # [masked rows] int64: the logits row each bitmask row masks
    scratch: torch.Tensor | None = None,  # [>= masked rows, >= vocab] logits.dtype, reused
) -> None:
    """Push every logit its row's grammar does not allow next down to the dtype's lowest value
    (as good as -inf: its probability is exactly 0), before sampling, so that the torch and the
    C sampling paths, greedy or not, see the same masked logits. Columns past the bitmask's
    width (a model whose vocabulary is wider than its tokenizer's) are refused too. In torch and
    numpy alone: the worker needs no grammar library (vLLM's `apply_grammar_bitmask`).

    An add of 0 or -max, through a `scratch` the caller keeps: on a CPU, masked_fill or where
    over a mask, or a fresh vocabulary-wide buffer each step (its pages faulted in anew), cost
    many times more than the add."""
    # Bits of the tokens refused: the complement of the bitmask.
    if bitmask.device.type == "cpu":  # little-endian words: byte 4w + k holds tokens 32w + 8k..
        refused = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        bits = torch.from_numpy(refused)
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = ((~bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)
    num, vocab = bits.shape[0], logits.shape[1]
    width = min(vocab, bits.shape[1])
    if scratch is None or scratch.shape[0] < num or scratch.shape[1] < width:
        scratch = torch.empty(num, width, dtype=logits.dtype, device=logits.device)
    penalty = scratch[:num, :width].copy_(bits[:, :width])
    lowest = -torch.finfo(logits.dtype).max
    # One add over the whole batch when every row is masked, in order (index_add_, or a loop of
    # row adds, took ten times longer on a CPU); else the masked rows gathered and put back.
    if num == logits.shape[0] and bool((rows == torch.arange(num, device=rows.device)).all()):
        logits[:, :width].add_(penalty, alpha=lowest)
        if width < vocab:
            logits[:, width:] = float("-inf")
        return
    masked = logits[rows]
    masked[:, :width].add_(penalty, alpha=lowest)
    masked[:, width:] = float("-inf")
    logits[rows] = masked


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
    def __init__(self, device: torch.device, seed: int = 0, cpu_kernels: bool = False) -> None:
        """`cpu_kernels`: find top-k / top-p with the CPU kernels' C routine (the CPU backend
        builds them) instead of torch's partial top-K."""
        self.device = device
        self.cpu_kernels = cpu_kernels
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
        token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            token_ids[rows] = scores[rows].argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) == len(params):  # every row sampled: no copy of the batch
            token_ids = self._sample_random(scores, params, generators)
        elif random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._sample_random(
                scores[rows], [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )
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

    def _sample_random(
        self,
        scores: torch.Tensor,  # [rows, vocab]
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:  # [rows] token ids
        dev = scores.device
        temperature = torch.tensor([p.temperature for p in params], device=dev)
        out = torch.empty(len(params), dtype=torch.long, device=dev)
        filtered = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1]
        plain = [j for j, p in enumerate(params) if not (p.top_k > 0 or p.top_p < 1)]
        if filtered:
            rows = torch.tensor(filtered, device=dev)
            top_k = torch.tensor([params[j].top_k for j in filtered], device=dev)
            top_p = torch.tensor([params[j].top_p for j in filtered], device=dev)
            batch = scores if len(filtered) == len(params) else scores[rows]
            temp = temperature if len(filtered) == len(params) else temperature[rows]
            if self.cpu_kernels:
                values, ids = cpu_ops.top_k_top_p(batch.contiguous(), temp, top_k, top_p)
            else:
                values, ids = top_k_top_p_candidates(batch / temp[:, None], top_k, top_p)
            out[rows] = self._draw(values, ids, [generators[j] for j in filtered])
        if plain:  # temperature alone: every token is a candidate
            rows = torch.tensor(plain, device=dev)
            scaled = scores[rows] / temperature[rows, None]
            out[rows] = self._draw(scaled, None, [generators[j] for j in plain])
        return out

    def _draw(
        self,
        values: torch.Tensor,  # [rows, K] logits of the candidates, -inf where dropped
        ids: torch.Tensor | None,  # [rows, K] their token ids; None: K is the vocabulary
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:  # [rows] token ids
        """Invert each row's cumulative distribution at one uniform draw: from the request's own
        generator where it has a seed (so its tokens depend on nothing else in the batch), else
        from one call for all the other rows."""
        dev = values.device
        # In float64: a float32 sum over a whole vocabulary drifts by ~1e-5, the size of one
        # token's share, so the last ulp of a logit (a batch of another size, a prefix-cache
        # hit) could move a seeded request onto another token.
        cdf = values.softmax(dim=-1, dtype=torch.float64).cumsum(dim=-1)
        u = torch.empty(len(generators), 1, dtype=torch.float64, device=dev)
        others = [j for j, g in enumerate(generators) if g is None]
        if others:
            u[others] = torch.rand(
                len(others), 1, generator=self.default_generator, dtype=torch.float64, device=dev
            )
        for j, g in enumerate(generators):
            if g is not None:
                u[j] = torch.rand(1, generator=g, dtype=torch.float64, device=dev)
        pick = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=cdf.shape[-1] - 1)
        return pick[:, 0] if ids is None else ids.gather(1, pick)[:, 0]
