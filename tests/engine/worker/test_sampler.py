"""The sampler's top-k / top-p without a sort, both ways (torch's partial top-K, and the CPU
kernel's threshold search): the same kept tokens as the sorted reference, the same distribution
as the sorted sampler (chi-square, unseeded and seeded draws), and seeded rows that get the same
tokens whatever else is in the batch."""

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
from stepscope.kernels.cpu import ops

VOCAB = 3000


def _kernel_candidates(logits, top_k, top_p):
    return ops.top_k_top_p(logits, torch.ones(len(logits)), top_k, top_p, capacity=8)


CANDIDATES = pytest.mark.parametrize(
    "candidates", [top_k_top_p_candidates, _kernel_candidates], ids=["torch", "cpu-kernel"]
)
BOTH_PATHS = pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch", "cpu-kernel"])


def _logits(rows: int, seed: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * spread


def _kept(values: torch.Tensor, ids: torch.Tensor) -> list[set[int]]:
    return [set(i[torch.isfinite(v)].tolist()) for v, i in zip(values, ids, strict=True)]


@CANDIDATES
@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])  # flat (wide nucleus) to peaked (narrow)
def test_candidates_keep_what_the_sorted_reference_keeps(spread, candidates):
    logits = _logits(12, seed=int(spread * 10), spread=spread)
    top_k = torch.tensor([0, 0, 0, 1, 5, 50, 2999, 3000, 0, 40, 0, 700])
    top_p = torch.tensor([0.9, 0.5, 0.999, 1.0, 0.8, 0.95, 0.9, 1.0, 0.01, 1.0, 0.3, 0.97])
    want = logits.clone()
    apply_top_k_top_p_sorted(want, top_k, top_p)
    values, ids = candidates(logits, top_k, top_p)
    assert _kept(values, ids) == [set(torch.isfinite(w).nonzero()[:, 0].tolist()) for w in want]
    # Kept logits are the row's own.
    kept = torch.isfinite(values)
    assert torch.equal(values[kept], logits.gather(1, ids)[kept])


def _seeded_run(
    seeded: SamplingParams, company: SamplingParams, width: int, cpu_kernels: bool
) -> list[int]:
    """20 steps of one seeded request among `width - 1` others, at a different row each step."""
    sampler = Sampler(torch.device("cpu"), seed=width, cpu_kernels=cpu_kernels)
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


@BOTH_PATHS
@pytest.mark.parametrize(
    "seeded",
    [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7), SamplingParams(seed=11)],
    ids=["top-k-top-p", "temperature"],
)
def test_a_seeded_request_gets_the_same_tokens_whatever_the_batch(seeded, cpu_kernels):
    alone = _seeded_run(seeded, seeded, 1, cpu_kernels)
    # Among rows with other settings (so other candidate widths), at other rows, in batches of
    # other sizes, under another engine seed.
    for company in (SamplingParams(temperature=1.0, top_p=0.99), SamplingParams(top_k=3)):
        for width in (3, 6):
            assert _seeded_run(seeded, company, width, cpu_kernels) == alone
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
@BOTH_PATHS
def test_draws_follow_the_sorted_distribution(params, seeded, cpu_kernels):
    """20,000 draws over a 12-token vocabulary, 100 rows per step (one uniform call for all, or
    each row its own seeded generator)."""
    sampler = Sampler(torch.device("cpu"), seed=3, cpu_kernels=cpu_kernels)
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


def test_both_paths_draw_the_same_seeded_tokens():
    """The kernel keeps the tokens torch's path keeps, in the same order: a seeded request's
    tokens do not depend on which backend the worker runs."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    assert _seeded_run(seeded, seeded, 1, True) == _seeded_run(seeded, seeded, 1, False)


@pytest.mark.parametrize("ties", [False, True], ids=["float32", "bfloat16-logits"])
def test_the_kernel_keeps_what_the_sorted_reference_keeps_with_temperature(ties):
    """Random rows of random widths, temperatures, top-k and top-p, from a small first output
    (so that the kernel is called again, wider). bfloat16 logits hold ties: where two tokens
    share a score at the cut, either may be kept, so there only the kept counts must agree."""
    g = torch.Generator().manual_seed(1)
    for case in range(40):
        vocab = int(torch.randint(2, 5000, (1,), generator=g))
        logits = torch.randn(8, vocab, generator=g) * [0.3, 1.0, 3.0, 8.0, 20.0][case % 5]
        if ties:
            logits = logits.to(torch.bfloat16).float()
        top_k = torch.randint(0, vocab + 2, (8,), generator=g)
        top_k[::2] = 0
        top_p = torch.rand(8, generator=g) * 0.99 + 0.01
        top_p[1::3] = 1.0
        top_k[1] = max(
            int(top_k[1]), 1
        )  # top_p 1 and top_k 0 is no filter: the sampler's plain rows
        temperature = torch.rand(8, generator=g) * 1.5 + 0.1
        want = logits / temperature[:, None]
        apply_top_k_top_p_sorted(want, top_k, top_p)
        values, ids = ops.top_k_top_p(logits, temperature, top_k, top_p, capacity=4)
        kept = torch.isfinite(values)
        assert torch.equal(values[kept], (logits / temperature[:, None]).gather(1, ids)[kept])
        assert (values[:, :-1] >= values[:, 1:]).all()  # largest first
        if ties:
            assert kept.sum(dim=1).tolist() == torch.isfinite(want).sum(dim=1).tolist()
        else:
            assert _kept(values, ids) == [
                set(torch.isfinite(w).nonzero()[:, 0].tolist()) for w in want
            ]


def test_the_kernel_refuses_what_the_sampler_never_sends():
    logits = torch.zeros(2, 10)
    ok = dict(
        temperature=torch.ones(2),
        top_k=torch.zeros(2, dtype=torch.long),
        top_p=torch.full((2,), 0.9),
    )
    bad_fields = {
        "temperature": torch.tensor([1.0, 0.0]),
        "top_p": torch.tensor([0.0, 0.5]),
        "top_k": torch.tensor([-1, 0]),
    }
    for field, bad in bad_fields.items():
        with pytest.raises(ValueError, match="must be"):
            ops.top_k_top_p(logits, **{**ok, field: bad})
    with pytest.raises(TypeError):
        ops.top_k_top_p(logits.double(), **ok)


@BOTH_PATHS
def test_a_temperature_below_float32s_range_samples_greedily(cpu_kernels):
    # 4.3e-65 is > 0 as a Python float but 0 in a float32 tensor: the C kernel refused it and
    # the worker died (found by schemathesis). Below SAMPLING_EPS a temperature is greedy.
    tiny = SamplingParams(temperature=4.341518308979434e-65, top_k=130)
    sampler = Sampler(torch.device("cpu"), seed=0, cpu_kernels=cpu_kernels)
    logits = _logits(3, seed=5, spread=2.0)
    params = [tiny, SamplingParams(temperature=0.8, top_k=130), tiny]
    out = sampler(logits, params, [None] * 3, [[1]] * 3, [1] * 3)
    assert [out.token_ids[i] for i in (0, 2)] == logits[[0, 2]].argmax(-1).tolist()
