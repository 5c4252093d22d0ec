"""The torch attention backend pads requests of similar length together: splitting a batch into
more groups changes the work, not the result; whole prompts attend causally with no mask (on a
CPU one by one); the cpu backend (decodes in its C kernel) gives the same result."""

from __future__ import annotations

import pytest
import torch

from stepscope.engine.layers.attention import (
    CpuAttentionBackend,
    SeqInfo,
    TorchAttentionBackend,
)
from stepscope.kernels.cpu.build import available as cpu_kernel_available

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 32


def _batch(lengths: list[tuple[int, int]]):
    """(query_len, seq_len) per request, decodes first, each sorted by context length as the
    model runner orders them; blocks handed out in order."""
    seqs, slots, next_block = [], [], 0
    for q, n in lengths:
        blocks = list(range(next_block, next_block + -(-n // BLOCK)))
        next_block += len(blocks)
        seqs.append(SeqInfo(q, n, blocks))
        pos = torch.arange(n - q, n)
        slots.append(torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK)
    return seqs, torch.cat(slots), next_block


def _attend(backend: TorchAttentionBackend, lengths, seed: int = 0):
    seqs, slots, num_blocks = _batch(lengths)
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g)
    tokens = sum(q for q, _ in lengths)
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=g)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=g)
    meta = backend.build_metadata(seqs, slots)
    return backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5), len(meta.groups)


LENGTHS = [(1, 20), (1, 30), (1, 200), (1, 700), (1, 900), (24, 24), (40, 300), (300, 300)]


def test_requests_of_different_lengths_get_their_own_groups() -> None:
    backend = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    _, groups = _attend(backend, LENGTHS)
    # Decodes 20-30 / 200 / 700-900, prefills 24 / 300 (q 40) / 300 (q 300): each run stays
    # within MAX_PAD_RATIO of its shortest member.
    assert groups == 6


def test_splitting_changes_nothing_in_the_result() -> None:
    split = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    whole = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    whole.MIN_SPLIT_TOKENS = 10**12  # one decode group; prefills cut only where fresh or not
    got, n_split = _attend(split, LENGTHS)
    ref, n_whole = _attend(whole, LENGTHS)
    assert (n_split, n_whole) == (6, 4)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_small_batch_stays_in_one_group_per_kind() -> None:
    backend = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    _, groups = _attend(backend, [(1, 16), (1, 100), (8, 40)])  # under MIN_SPLIT_TOKENS
    assert groups == 2


def test_whole_prompts_attend_causally_without_a_mask_and_agree() -> None:
    causal = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    masked = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    masked.CAUSAL_PROMPTS = False
    lengths = [(24, 24), (40, 40), (300, 300)]  # three whole prompts: nothing cached before
    seqs, slots, _ = _batch(lengths)
    assert all(g.mask is None for g in causal.build_metadata(seqs, slots).groups)
    got, _ = _attend(causal, lengths)
    ref, _ = _attend(masked, lengths)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_whole_prompts_on_a_cpu_attend_one_by_one_and_agree_with_the_padded_batch() -> None:
    alone = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    padded = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    padded.FRESH_PROMPTS_ALONE_ON_CPU = False
    lengths = [(1, 40), (100, 100), (120, 120), (150, 150), (190, 190)]  # one run of prompts
    seqs, slots, _ = _batch(lengths)
    prompts = [g for g in alone.build_metadata(seqs, slots).groups if g.mask is None]
    assert [g.rows.stop - g.rows.start for g in prompts] == [100, 120, 150, 190]
    assert len([g for g in padded.build_metadata(seqs, slots).groups if g.mask is None]) == 1
    got, _ = _attend(alone, lengths)
    ref, _ = _attend(padded, lengths)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_kernel_available() is not None, reason="no C compiler for the kernels")
def test_cpu_backend_gives_the_torch_backends_result() -> None:
    cpu = CpuAttentionBackend(BLOCK, torch.device("cpu"))
    meta = cpu.build_metadata(*_batch(LENGTHS)[:2])
    assert meta.num_decodes == 5 and meta.max_decode_len == 900
    assert meta.groups == []  # decodes and prefills both go to kernels
    # Each prefill: (request, first row, end row, context_len), rows after the 5 decodes.
    assert meta.prefills == [(5, 5, 29, 0), (6, 29, 69, 260), (7, 69, 369, 0)]
    got, _ = _attend(cpu, LENGTHS)
    ref, _ = _attend(TorchAttentionBackend(BLOCK, torch.device("cpu")), LENGTHS)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bf16"]
)
def test_a_chunk_after_its_context_attends_it_unmasked_and_agrees(dtype, tol) -> None:
    split = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    masked = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    masked.SPLIT_CHUNKS = False
    # A decode, a whole prompt, a chunk after 260 cached tokens, one after 700 (a prefix hit).
    lengths = [(1, 50), (24, 24), (40, 300), (200, 900)]
    seqs, slots, _ = _batch(lengths)
    groups = split.build_metadata(seqs, slots).groups
    chunks = [g for g in groups if g.context_len]
    assert [g.context_len for g in chunks] == [260, 700]
    assert all(g.mask is None and g.max_blocks == -(-g.context_len // BLOCK) for g in chunks)
    assert all(not g.context_len for g in masked.build_metadata(seqs, slots).groups)
    got = _attend_in(split, lengths, dtype)
    ref = _attend_in(masked, lengths, dtype)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_chunks_sharing_a_group_keep_the_mask_and_whole_prompts_stay_apart() -> None:
    backend = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    backend.MIN_SPLIT_TOKENS = 10**12  # no cuts by length: only fresh against not
    seqs, slots, _ = _batch([(24, 24), (40, 300), (50, 320), (30, 30)])
    groups = backend.build_metadata(seqs, slots).groups
    # Whole prompt | two chunks with context (one padded, masked call) | whole prompt.
    assert [(g.mask is None, g.context_len) for g in groups] == [
        (True, 0),
        (False, 0),
        (True, 0),
    ]


def _attend_in(backend: TorchAttentionBackend, lengths, dtype: torch.dtype) -> torch.Tensor:
    """`_attend` with every tensor in `dtype`."""
    seqs, slots, num_blocks = _batch(lengths)
    g = torch.Generator().manual_seed(1)
    tokens = sum(q for q, _ in lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_cache, v_cache = (
        randn(num_blocks, BLOCK, KV_HEADS, DIM),
        randn(num_blocks, BLOCK, KV_HEADS, DIM),
    )
    q, k, v = randn(tokens, HEADS, DIM), randn(tokens, KV_HEADS, DIM), randn(tokens, KV_HEADS, DIM)
    meta = backend.build_metadata(seqs, slots)
    return backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5).float()
