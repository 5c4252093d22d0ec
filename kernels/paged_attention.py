"""Paged attention for the worker forward: one launch serves a mixed batch of prefill chunks and
single-token decodes, reading keys and values from the paged KV cache through block tables.

Each program owns one query tile of one sequence for one KV head. The tile packs BLOCK_Q query
tokens times the G query heads that share that KV head (GQA) into BLOCK_M = BLOCK_Q * G rows, so a
decode batch does not waste rows on padding. Keys and values are visited in tiles of TILE_N
positions with an online softmax accumulated in float32. The grid is an upper bound on the number
of query tiles (num_tokens // BLOCK_Q + num_seqs, as in vLLM's unified attention); each program
finds its sequence by a binary search over query_start_loc, so the launcher never syncs with the
device.

With a sliding window of W keys, a query at position p sees keys p - W + 1 .. p: a tile starts
at its first query's first key, so the blocks wholly before it are never read (the KV manager
may have freed them and left a null block id in the table). With logit soft-capping (Gemma 2 and
3's attn_logit_softcapping c), each score becomes c * tanh(score / c) before the softmax.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def paged_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    sliding_window=None,
    logits_soft_cap=None,
):
    """`paged_attention` (same arguments and shapes) in plain PyTorch: causal attention over the
    paged cache, one sequence at a time, in float32."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[q_start:q_end].float().transpose(0, 1)  # [num_heads, q_len, head_dim]
        scores = qi @ k.transpose(1, 2) * scale  # [num_heads, q_len, seq_len]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        hidden = k_pos[None, None, :] > q_pos[None, :, None]
        if sliding_window:
            hidden |= k_pos[None, None, :] <= q_pos[None, :, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        out[q_start:q_end] = (scores.softmax(dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tile_idx,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    # Sequence i owns tiles from query_start_loc[i] // BLOCK_Q + i on; return the last i whose
    # first tile is <= tile_idx.
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale,
    num_seqs,
    block_size,
    head_dim,
    window,  # keys a query sees, its own included; 0: all
    soft_cap,  # scores bounded to soft_cap * tanh(score / soft_cap) where SOFT_CAP
    stride_ot,
    stride_oh,
    stride_od,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q tokens x GROUP heads, padded to a power of 2
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # key positions per inner iteration
    HEAD_DIM: tl.constexpr,  # head_dim padded to a power of 2
    DOT_IN_FP32: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq_idx = _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_tile = tile_idx - (q_start // BLOCK_Q + seq_idx)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    q_in_tile = offs_m // GROUP
    q_pos = q_tile * BLOCK_Q + q_in_tile  # position within this sequence's query
    head = kv_head * GROUP + offs_m % GROUP
    row_mask = (q_in_tile < BLOCK_Q) & (q_pos < q_len)
    d_mask = offs_d < head_dim
    q_abs_pos = context_len + q_pos  # position in the whole sequence, for the causal mask

    q_offs = (q_start + q_pos)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(
        q_ptr + q_offs + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Keys past the last query row of this tile are masked for every row: skip them; and with a
    # window, those before its first row's first key.
    num_keys = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    first_key = tl.where(window > 0, tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0), 0)
    # A while loop, not range(): Triton 3.5.1's interpreter cannot take a runtime loop bound
    # under numpy >= 2.4 (triton-lang/triton#9171).
    start_n = first_key
    while start_n < num_keys:
        k_pos = start_n + offs_n
        k_mask = k_pos < num_keys
        block_ids = tl.load(
            block_tables_ptr + seq_idx * stride_bt + k_pos // block_size, mask=k_mask, other=0
        ).to(tl.int64)
        slot_in_block = k_pos % block_size
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + block_ids[:, None] * stride_kb
            + slot_in_block[:, None] * stride_ks
            + kv_head * stride_kh
            + offs_d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        # Unwritten cache slots may hold NaN; masked loads keep them out of 0 * NaN in p @ v.
        v = tl.load(
            v_cache_ptr
            + block_ids[:, None] * stride_vb
            + slot_in_block[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, TILE_N]
        if SOFT_CAP:  # tanh(x) = 1 - 2 / (e^2x + 1): exact at both ends (e^2x 0 or inf)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        causal = (k_pos[None, :] <= q_abs_pos[:, None]) & k_mask[None, :]
        causal &= (window == 0) | (k_pos[None, :] > q_abs_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Padding rows see no key at all; keep their max finite so exp() gives 0, not NaN.
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
        start_n += TILE_N

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    out_offs = (q_start + q_pos)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(
        out_ptr + out_offs + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new query tokens
    scale: float,
    sliding_window: int | None = None,  # keys a query sees, its own included; None: all
    logits_soft_cap: float | None = None,  # scores become c * tanh(score / c); None: as they are
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of a mixed prefill+decode batch over the paged KV cache."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    # Every sequence has at least one query token, so num_tokens == num_seqs means a pure decode
    # batch: one token per tile is enough, and tl.dot needs at least 16 rows.
    min_rows = 16 if num_tokens == num_seqs else 64
    block_m = max(min_rows, triton.next_power_of_2(group))
    block_q = block_m // group
    tile_n = 64 if head_dim <= 64 else 32
    # The interpreter holds bf16 as raw uint16 bits, so its tl.dot is only right in float32.
    interpreted = isinstance(_paged_attention_kernel, InterpretedFunction)
    dot_in_fp32 = q.dtype == torch.float32 or interpreted

    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        num_seqs,
        block_size,
        head_dim,
        sliding_window or 0,
        logits_soft_cap or 1.0,
        *out.stride(),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        HEAD_DIM=triton.next_power_of_2(head_dim),
        DOT_IN_FP32=dot_in_fp32,
        SOFT_CAP=logits_soft_cap is not None,
    )
    return out
