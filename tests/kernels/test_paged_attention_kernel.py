"""Paged attention kernel against its PyTorch reference over mixed prefill+decode batches."""

import pytest
import torch

from stepscope.kernels.paged_attention import paged_attention, paged_attention_ref


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict:
    """Arguments for paged_attention, with each sequence's blocks scattered over the cache.

    Cache slots no sequence has written hold NaN (block 0 is never handed out, so a masked gather
    that falls back to block 0 lands on NaN too) and block-table padding points far outside the
    cache, so a kernel that reads past a sequence's length fails the comparison.
    """
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    physical = (1 + torch.randperm(num_blocks - 1)).int().to(device)
    block_tables = torch.full(
        (len(seq_lens), max(blocks_per_seq) + 1), num_blocks + 1000, dtype=torch.int32
    ).to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    used = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        block_tables[i, :n] = physical[used : used + n]
        used += n
        pos = torch.arange(seq_len, device=device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        kv_shape = (seq_len, num_kv_heads, head_dim)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(kv_shape).to(device, dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(kv_shape).to(device, dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(device, dtype)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "scale": head_dim**-0.5,
    }


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_matches_reference_for_mixed_prefill_and_decode(
    block_size: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    tol: dict[str, float],
    device: torch.device,
) -> None:
    # A fresh prefill, decodes just past and exactly at a block boundary, and a prefill chunk
    # whose cached context crosses block boundaries.
    q_lens = [19, 1, 1, 7]
    seq_lens = [19, block_size + 1, block_size, 2 * block_size + 7]
    batch = make_batch(q_lens, seq_lens, block_size, 2, group, head_dim, dtype, device)

    out = paged_attention(**batch)

    assert out.dtype == dtype
    torch.testing.assert_close(out, paged_attention_ref(**batch), **tol)


@pytest.mark.parametrize("num_seqs", [1, 6])
def test_paged_attention_matches_reference_for_decode_only_batch(
    num_seqs: int, device: torch.device
) -> None:
    seq_lens = [1 + 13 * i for i in range(num_seqs)]
    batch = make_batch([1] * num_seqs, seq_lens, 16, 3, 3, 64, torch.float32, device)

    torch.testing.assert_close(paged_attention(**batch), paged_attention_ref(**batch))


def test_paged_attention_matches_reference_for_prefill_spanning_several_query_tiles(
    device: torch.device,
) -> None:
    # With one query head per KV head a query tile holds 64 tokens: 70 new tokens need two, and
    # the second sequence's 70 tokens follow 20 cached ones.
    batch = make_batch([70, 70, 1], [70, 90, 40], 32, 1, 1, 64, torch.float32, device)

    torch.testing.assert_close(paged_attention(**batch), paged_attention_ref(**batch))


def test_paged_attention_never_reads_cache_beyond_seq_len(device: torch.device) -> None:
    # make_batch leaves NaN in unwritten slots and out-of-range ids in block-table padding.
    batch = make_batch([3, 1], [3, 17], 16, 2, 2, 64, torch.float32, device)

    assert torch.isfinite(paged_attention(**batch)).all()


def test_paged_attention_accepts_query_sliced_from_fused_qkv(device: torch.device) -> None:
    batch = make_batch([9, 1], [9, 40], 16, 2, 3, 64, torch.float32, device)
    num_tokens, num_heads, head_dim = batch["q"].shape
    qkv = torch.randn(num_tokens, (num_heads + 4) * head_dim, device=device)
    qkv[:, : num_heads * head_dim] = batch["q"].reshape(num_tokens, -1)
    batch["q"] = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)

    assert not batch["q"].is_contiguous()
    torch.testing.assert_close(paged_attention(**batch), paged_attention_ref(**batch))


@pytest.mark.parametrize("cap", [None, 2.0], ids=["window", "window_and_soft_cap"])
def test_paged_attention_with_a_window_never_reads_the_blocks_behind_it(
    device: torch.device, dtype: torch.dtype, tol: dict[str, float], cap: float | None
) -> None:
    # Decodes before and past the window, a whole prompt longer than it, chunks straddling it.
    q_lens, seq_lens, window, block_size = [1, 1, 70, 30, 100], [30, 300, 70, 200, 260], 40, 32
    batch = make_batch(q_lens, seq_lens, block_size, 2, 2, 64, dtype, device)
    if cap is not None:
        batch["q"] *= 4  # scores of a few units, which a cap of 2 bends
    want = paged_attention_ref(**batch, sliding_window=window, logits_soft_cap=cap)
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        first_key = max(0, seq_len - q_len - window + 1)
        batch["block_tables"][i, : first_key // block_size] = 0  # block 0 holds NaN
    got = paged_attention(**batch, sliding_window=window, logits_soft_cap=cap)

    torch.testing.assert_close(got, want, **tol)
