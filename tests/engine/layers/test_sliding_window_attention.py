"""Sliding-window attention in every backend (torch, cpu, triton), decode and chunked prefill,
against a dense masked reference in plain torch: a query at position p sees keys p - W + 1 .. p.
And attention logit soft-capping (scores c * tanh(score / c)), with a window and without.

The blocks wholly before the first key a request's queries see are replaced in its block table
by the null block (id 0), as the KV manager does when it frees them; the null block holds NaN,
so a backend that read it, masked or not, would fail the comparison."""

from __future__ import annotations

import pytest
import torch

from stepscope.engine.layers.attention import (
    AttentionBackend,
    SeqInfo,
    make_attention_backend,
)
from stepscope.kernels.cpu.build import available as cpu_kernel_available

HEADS, KV_HEADS, DIM = 4, 2, 32
NULL_BLOCK = 0

needs_cc = pytest.mark.skipif(cpu_kernel_available() is not None, reason="no C compiler")


def _step(lengths: list[tuple[int, int]], window: int | None, block: int, dtype, seed: int = 0):
    """One step of requests given as (query_len, seq_len), decodes first: the dense K/V of each
    request, its queries, and the paged cache holding its context, with the blocks the window
    left behind swapped for the null block. Physical blocks are shuffled; slots not yet written
    hold stale values (a backend may read them if it masks them), the null block and the blocks
    the window freed NaN (no backend may read them)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-n // block) for _, n in lengths)
    physical = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    shape = (num_blocks, block, KV_HEADS, DIM)
    k_cache = (100 * torch.randn(shape, generator=g)).to(dtype)
    v_cache = (100 * torch.randn(shape, generator=g)).to(dtype)
    k_cache[NULL_BLOCK] = v_cache[NULL_BLOCK] = float("nan")
    seqs, slots, dense, new = [], [], [], []
    for q_len, n in lengths:
        blocks = [physical.pop() for _ in range(-(-n // block))]
        keys, values = (torch.randn(n, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(q_len, HEADS, DIM, generator=g).to(dtype)
        pos = torch.arange(n)
        where = torch.tensor(blocks)[pos // block] * block + pos % block
        context = n - q_len
        k_cache.view(-1, KV_HEADS, DIM)[where[:context]] = keys[:context]
        v_cache.view(-1, KV_HEADS, DIM)[where[:context]] = values[:context]
        slots.append(where[context:])
        first_key = max(0, context - window + 1) if window else 0
        for b in range(first_key // block):  # wholly before the first query's first key
            k_cache[blocks[b]] = v_cache[blocks[b]] = float("nan")  # freed, reused by others
            blocks[b] = NULL_BLOCK
        seqs.append(SeqInfo(q_len, n, blocks))
        dense.append((q, keys, values))
        new.append((keys[context:], values[context:]))
    q = torch.cat([d[0] for d in dense])
    k = torch.cat([x[0] for x in new])
    v = torch.cat([x[1] for x in new])
    return seqs, torch.cat(slots), q, k, v, k_cache, v_cache, dense


def _reference(dense, window: int | None, scale: float, cap: float | None = None) -> torch.Tensor:
    """Each request's queries over its dense keys, masked causally and by the window."""
    out = []
    for q, keys, values in dense:
        n, q_len = keys.shape[0], q.shape[0]
        q_pos = torch.arange(n - q_len, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        seen = k_pos <= q_pos
        if window is not None:
            seen &= k_pos > q_pos - window
        group = HEADS // KV_HEADS
        kh = keys.double().repeat_interleave(group, dim=1)  # [n, H, D]
        vh = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), kh) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        scores = scores.masked_fill(~seen[None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh))
    return torch.cat(out)


def _run(name: str, lengths, window, block: int = 16, dtype=torch.float32, cap=None):
    seqs, slots, q, k, v, k_cache, v_cache, dense = _step(lengths, window, block, dtype)
    backend: AttentionBackend = make_attention_backend(name, block, torch.device("cpu"))
    meta = backend.build_metadata(seqs, slots)
    # Scores of a few units (the queries scaled up), so that a cap of 2 bends most of them.
    scale = 4 * DIM**-0.5 if cap else DIM**-0.5
    extra = {} if cap is None else {"logits_soft_cap": cap}
    got = backend.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window=window, **extra)
    return got, _reference(dense, window, scale, cap)


# (query_len, seq_len) per request, decodes first.
CASES = {
    # Decodes before, at and past the window, one past many freed blocks.
    "decodes": [(1, 5), (1, 24), (1, 25), (1, 40), (1, 97), (1, 300)],
    # Whole prompts shorter and longer than the window.
    "fresh_prompts": [(10, 10), (24, 24), (60, 60), (150, 150)],
    # Chunks after cached context, straddling the window's edge and well past it.
    "chunks": [(8, 20), (30, 50), (17, 130), (64, 400)],
    # Everything in one batch.
    "mixed": [(1, 7), (1, 200), (1, 33), (20, 20), (90, 90), (40, 100), (5, 260)],
}


@pytest.mark.parametrize("window", [8, 24, 40])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", ["torch", pytest.param("cpu", marks=needs_cc)])
def test_windowed_attention_matches_the_dense_masked_reference(name, case, window) -> None:
    got, want = _run(name, CASES[case], window)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@needs_cc
@pytest.mark.parametrize("cap", [None, 2.0])
def test_cpu_windowed_attention_in_bfloat16_matches_the_reference(cap) -> None:
    got, want = _run("cpu", CASES["mixed"], 24, dtype=torch.bfloat16, cap=cap)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", ["torch", pytest.param("cpu", marks=needs_cc)])
def test_a_window_no_request_reaches_changes_nothing(name) -> None:
    lengths = [(1, 30), (20, 20), (10, 40)]
    wide, want = _run(name, lengths, 64)
    none, _ = _run(name, lengths, None)
    torch.testing.assert_close(wide, none, rtol=0, atol=0)
    torch.testing.assert_close(none.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["torch", pytest.param("cpu", marks=needs_cc)])
def test_layers_with_and_without_a_window_share_one_metadata(name) -> None:
    """As Gemma 3's local and global layers do when the manager keeps every block."""
    lengths = CASES["mixed"]
    seqs, slots, q, k, v, k_cache, v_cache, dense = _step(lengths, None, 16, torch.float32)
    backend = make_attention_backend(name, 16, torch.device("cpu"))
    meta = backend.build_metadata(seqs, slots)
    for window in (None, 24, None, 24, 8):
        got = backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5, sliding_window=window)
        want = _reference(dense, window, DIM**-0.5)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("name", ["torch", pytest.param("cpu", marks=needs_cc)])
def test_soft_capped_attention_matches_the_reference(name, window) -> None:
    got, want = _run(name, CASES["mixed"], window, cap=2.0)
    uncapped, _ = _run(name, CASES["mixed"], window)
    assert (got - uncapped).abs().max() > 0.1  # the cap changed the result
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("window", "cap"), [(40, None), (40, 2.0)])
def test_triton_windowed_attention_matches_the_dense_masked_reference(window, cap) -> None:
    """Interpreted on a CPU: few, large blocks."""
    lengths = [(1, 40), (1, 300), (50, 50), (100, 100), (40, 200)]
    got, want = _run("triton", lengths, window, block=64, cap=cap)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
