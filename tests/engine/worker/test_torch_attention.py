"""The torch attention backend pads requests of similar length together: splitting a batch into
more groups changes the work, not the result."""

from __future__ import annotations

import torch

from stepscope.engine.worker.attention import SeqInfo, TorchAttentionBackend

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
    whole.MIN_SPLIT_TOKENS = 10**12  # one decode group and one prefill group
    got, n_split = _attend(split, LENGTHS)
    ref, n_whole = _attend(whole, LENGTHS)
    assert (n_split, n_whole) == (6, 2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_small_batch_stays_in_one_group_per_kind() -> None:
    backend = TorchAttentionBackend(BLOCK, torch.device("cpu"))
    _, groups = _attend(backend, [(1, 16), (1, 100), (8, 40)])  # under MIN_SPLIT_TOKENS
    assert groups == 2
