"""The sampler's top-k / top-p without a sort: the same kept tokens as the sorted reference, the
same distribution (chi-square), the same tokens for seeded rows as the sorted sampler drew them,
and seeded rows that reproduce whatever else is in the batch."""

from __future__ import annotations

import math

import pytest
import torch

from stepscope.engine.sampling_params import SamplingParams
from stepscope.engine.worker.sampler import (
    Sampler,
    apply_top_k_top_p_sorted,
    top_k_top_p_candidates,
)

VOCAB = 3000


def _logits(rows: int, seed: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * spread


def _kept(values: torch.Tensor, ids: torch.Tensor) -> list[set[int]]:
    return [set(i[torch.isfinite(v)].tolist()) for v, i in zip(values, ids, strict=True)]


@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])  # flat (wide nucleus) to peaked (narrow)
def test_candidates_keep_what_the_sorted_reference_keeps(spread):
    logits = _logits(12, seed=int(spread * 10), spread=spread)
    top_k = torch.tensor([0, 0, 0, 1, 5, 50, 2999, 3000, 0, 40, 0, 700])
    top_p = torch.tensor([0.9, 0.5, 0.999, 1.0, 0.8, 0.95, 0.9, 1.0, 0.01, 1.0, 0.3, 0.97])
    want = logits.clone()
    apply_top_k_top_p_sorted(want, top_k, top_p)
    values, ids = top_k_top_p_candidates(logits, top_k, top_p)
    assert _kept(values, ids) == [set(torch.isfinite(w).nonzero()[:, 0].tolist()) for w in want]
    # Kept logits are the row's own.
    kept = torch.isfinite(values)
    assert torch.equal(values[kept], logits.gather(1, ids)[kept])


def _sorted_sampler_token(logits, params, generator) -> int:
    """Yesterday's sampler for one seeded row: sort-based mask, exponential race."""
    sub = (logits / params.temperature)[None].clone()
    apply_top_k_top_p_sorted(sub, torch.tensor([params.top_k]), torch.tensor([params.top_p]))
    probs = sub.softmax(dim=-1)[0]
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def test_seeded_rows_draw_the_sorted_samplers_tokens_whatever_the_batch():
    sampler = Sampler(torch.device("cpu"), seed=0)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    other = SamplingParams(temperature=1.0, top_p=0.95)
    reference = torch.Generator().manual_seed(7)
    ours = torch.Generator().manual_seed(7)
    for step in range(20):
        logits = _logits(4, seed=100 + step, spread=2.0)
        # The seeded row sits at a different place, among different company, each step.
        row = step % 4
        params = [other] * 4
        params[row] = seeded
        gens = [None] * 4
        gens[row] = ours
        out = sampler(logits, params, gens, [[1]] * 4, [1] * 4)
        assert out.token_ids[row] == _sorted_sampler_token(logits[row], seeded, reference)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square of `counts` against `probs` (bins with expectation >= 5),
    via the Wilson-Hilferty normal approximation."""
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=6, top_p=0.9),
    ],
    ids=["temperature", "top-p", "top-k-top-p"],
)
def test_unseeded_draws_follow_the_sorted_distribution(params):
    """20,000 draws over a 12-token vocabulary, 100 rows per step (one uniform draw for all)."""
    sampler = Sampler(torch.device("cpu"), seed=3)
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -2.0, -3.0])
    want = (logits / params.temperature)[None].clone()
    apply_top_k_top_p_sorted(want, torch.tensor([params.top_k]), torch.tensor([params.top_p]))
    probs = want.softmax(dim=-1)[0]
    counts = torch.zeros(len(logits))
    rows = 100
    for _ in range(200):
        out = sampler(logits.repeat(rows, 1), [params] * rows, [None] * rows, [[1]] * rows,
                      [1] * rows)  # fmt: skip
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=len(logits))
    assert counts[probs == 0].sum() == 0  # nothing outside top-k / top-p
    assert _chi_square_p(counts, probs) > 1e-3
