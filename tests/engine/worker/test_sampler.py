"""The sampler's top-k / top-p without a sort: the same kept tokens as the sorted reference, the
same distribution as the sorted sampler (chi-square, unseeded and seeded draws), and seeded rows
that get the same tokens whatever else is in the batch."""

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


def _seeded_run(seeded: SamplingParams, company: SamplingParams, width: int) -> list[int]:
    """20 steps of one seeded request among `width - 1` others, at a different row each step."""
    sampler = Sampler(torch.device("cpu"), seed=width)
    gen = torch.Generator().manual_seed(seeded.seed)
    tokens = []
    for step in range(20):
        row = step % width
        logits = _logits(width, seed=1000 * width + step, spread=2.0)
        logits[row] = _logits(1, seed=100 + step, spread=2.0)[0]  # the seeded request's own
        params = [company] * width
        params[row] = seeded
        gens: list = [None] * width
        gens[row] = gen
        tokens.append(sampler(logits, params, gens, [[1]] * width, [1] * width).token_ids[row])
    return tokens


@pytest.mark.parametrize(
    "seeded",
    [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7), SamplingParams(seed=11)],
    ids=["top-k-top-p", "temperature"],
)
def test_a_seeded_request_gets_the_same_tokens_whatever_the_batch(seeded):
    alone = _seeded_run(seeded, seeded, width=1)
    # Among rows with other settings (so other candidate widths), at other rows, in batches of
    # other sizes, under another engine seed.
    for company in (SamplingParams(temperature=1.0, top_p=0.99), SamplingParams(top_k=3)):
        for width in (3, 6):
            assert _seeded_run(seeded, company, width) == alone
    assert len(set(alone)) > 5  # it did sample


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
@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_draws_follow_the_sorted_distribution(params, seeded):
    """20,000 draws over a 12-token vocabulary, 100 rows per step (one uniform call for all, or
    each row its own seeded generator)."""
    sampler = Sampler(torch.device("cpu"), seed=3)
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -2.0, -3.0])
    want = (logits / params.temperature)[None].clone()
    apply_top_k_top_p_sorted(want, torch.tensor([params.top_k]), torch.tensor([params.top_p]))
    probs = want.softmax(dim=-1)[0]
    counts = torch.zeros(len(logits))
    rows = 100
    for step in range(200):
        gens = [torch.Generator().manual_seed(step * rows + i) for i in range(rows)]
        out = sampler(logits.repeat(rows, 1), [params] * rows, gens if seeded else [None] * rows,
                      [[1]] * rows, [1] * rows)  # fmt: skip
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=len(logits))
    assert counts[probs == 0].sum() == 0  # nothing outside top-k / top-p
    assert _chi_square_p(counts, probs) > 1e-3
