"""How the torch attention backend batches a step's requests into SDPA calls (worker forward,
stage 6): the requests as attention sees them (`SeqInfo`), and the padded groups built from
them once per step (`PaddedGroup`): decodes and prompt chunks gathered through their block
tables with a mask, whole prompts over their own keys, a lone chunk after cached context in
two unmasked halves. With a sliding window a group reads only the blocks its queries' window
reaches (engine/layers/attention.py says which groups a layer uses)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SeqInfo:
    """One scheduled request as attention needs it."""

    query_len: int  # tokens computed this step
    seq_len: int  # context length after this step, query included
    block_ids: list[int]


@dataclass(slots=True)
class PaddedGroup:
    """Requests of similar shape padded into one batched SDPA call (torch backend)."""

    q_index: torch.Tensor | None  # [B, Qmax] flat row of each padded query; None: one per row
    rows: slice  # the flat rows this group's requests occupy (contiguous, decodes first)
    q_valid: torch.Tensor | None  # [B, Qmax] bool; None when every query is real
    kv_blocks: torch.Tensor  # [B * max_blocks] block ids to gather (a row padded with its last)
    max_blocks: int  # 0: whole prompts, attending their own keys (nothing gathered)
    # [B, 1, Qmax, max_blocks * block_size] bool, True where attended; None for a group of
    # whole prompts (no earlier context), which attends its own fresh keys causally, and for
    # a lone prompt chunk after cached context (context_len > 0). With a sliding window, whole
    # prompts longer than it have one: [B, 1, Qmax, Qmax] over their own keys.
    mask: torch.Tensor | None
    # A lone prompt chunk's cached context: its first context_len keys, read through kv_blocks
    # and attended without a mask; its own keys attend causally (two calls, merged).
    context_len: int = 0


def host_tables(seqs: list[SeqInfo]) -> tuple[torch.Tensor, torch.Tensor]:
    """query_start_loc [num_seqs + 1] and block_tables [num_seqs, max_blocks], int32, on the
    host (a row's tail past its blocks is 0)."""
    q_lens = torch.tensor([s.query_len for s in seqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    max_blocks = max(len(s.block_ids) for s in seqs)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seqs):
        block_tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
    return query_start_loc, block_tables


def is_fresh_prompt(s: SeqInfo) -> bool:
    """A whole prompt in this step: nothing cached before it."""
    return 1 < s.query_len == s.seq_len


def runs_of_fresh_prompts(seqs: list[SeqInfo], first: int, last: int) -> list[tuple[int, int]]:
    """Rows [first, last) cut where whole prompts give way to rows with context, or back:
    whole prompts attend without a gather or mask, so they are never padded with the rest."""
    runs, start = [], first
    for i in range(first + 1, last):
        if is_fresh_prompt(seqs[i]) != is_fresh_prompt(seqs[start]):
            runs.append((start, i))
            start = i
    runs.append((start, last))
    return runs


def padded_group(
    first: int,
    last: int,
    seqs: list[SeqInfo],
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, on the host
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, on the host
    block_size: int,
    device: torch.device,
    window: int | None = None,
) -> PaddedGroup:
    """Requests [first, last), gathered through their block tables, with a mask."""
    bs = block_size
    group = seqs[first:last]
    q_lens = torch.tensor([s.query_len for s in group])
    seq_lens = torch.tensor([s.seq_len for s in group])
    q_max = int(q_lens.max())
    # With a window, each request's gather starts at the block of its first query's first
    # key: the blocks before it are never read (the manager may have freed them).
    skip = torch.zeros(len(group), dtype=torch.long)
    if window is not None:
        skip = (seq_lens - q_lens - window + 1).clamp(min=0) // bs
    blocks = -(-seq_lens // bs)  # each request's blocks, read or not
    max_blocks = int((blocks - skip).max())
    # A shorter request's row is padded with its own last block (read, masked): never the
    # null block, nor another request's.
    columns = (skip[:, None] + torch.arange(max_blocks)).clamp(max=(blocks - 1)[:, None])
    kv_blocks = block_tables[first:last].long().gather(1, columns)
    key_pos = (skip * bs)[:, None] + torch.arange(max_blocks * bs)  # [B, keys] in request
    j = torch.arange(q_max)
    q_valid = j[None, :] < q_lens[:, None]
    # Query j of a request sits at absolute position seq_len - q_len + j (causal bound).
    q_pos = (seq_lens - q_lens)[:, None] + j[None, :]
    mask = key_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= key_pos[:, None, :] > q_pos[:, :, None] - window
    mask[~q_valid] = False
    mask[..., 0] |= ~q_valid  # padded queries attend one key: no all-masked rows
    first_row, last_row = int(query_start_loc[first]), int(query_start_loc[last])
    q_index = None
    if q_max > 1:
        q_index = torch.where(q_valid, query_start_loc[first:last, None] + j[None, :], 0)
    return PaddedGroup(
        q_index=None if q_index is None else q_index.to(device),
        rows=slice(first_row, last_row),
        q_valid=None if q_index is None else q_valid.to(device),
        kv_blocks=kv_blocks.flatten().to(device),
        max_blocks=max_blocks,
        mask=mask[:, None].to(device),
    )


def fresh_group(
    first: int,
    last: int,
    seqs: list[SeqInfo],
    query_start_loc: torch.Tensor,
    device: torch.device,
    window: int | None = None,
) -> PaddedGroup:
    """Whole prompts: every key is one of this step's own tokens, so nothing is read back
    from the cache, and a causal SDPA needs no mask (unless a window hides keys: then one
    over their own keys). Padding goes at the end, where no real query looks (query j
    attends keys 0..j)."""
    group = seqs[first:last]
    q_lens = torch.tensor([s.query_len for s in group])
    j = torch.arange(int(q_lens.max()))
    q_valid = j[None, :] < q_lens[:, None]
    mask = None
    if window is not None and int(q_lens.max()) > window:
        mask = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - window)
        mask = mask[None, None].expand(len(group), 1, -1, -1).to(device)
    q_index = torch.where(q_valid, query_start_loc[first:last, None] + j[None, :], 0)
    first_row, last_row = int(query_start_loc[first]), int(query_start_loc[last])
    return PaddedGroup(
        q_index=q_index.to(device),
        rows=slice(first_row, last_row),
        q_valid=q_valid.to(device),
        kv_blocks=torch.empty(0, dtype=torch.long, device=device),
        max_blocks=0,
        mask=mask,
    )


def chunk_group(
    i: int,
    seqs: list[SeqInfo],
    query_start_loc: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> PaddedGroup:
    """A prompt chunk with context_len cached keys before it (seqs[i] alone)."""
    s = seqs[i]
    context_len = s.seq_len - s.query_len
    blocks = -(-context_len // block_size)
    return PaddedGroup(
        q_index=None,
        rows=slice(int(query_start_loc[i]), int(query_start_loc[i + 1])),
        q_valid=None,
        kv_blocks=block_tables[i, :blocks].long().to(device),
        max_blocks=blocks,
        mask=None,
        context_len=context_len,
    )
