"""KV-cache write for the worker forward: after the K and V projections (and rotary), each new
token's keys and values go into its slot of the paged cache, slot = block_id * block_size + offset.
Negative slots (padding tokens) are skipped.

Each program copies BLOCK_T tokens; a token's num_kv_heads * head_dim values are handled as one
flat row, so a whole token moves in one masked load and store.
"""

import torch
import triton
import triton.language as tl


def write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """`write_kv_cache` (same arguments and shapes) in plain PyTorch: scatter key and value rows
    into their cache slots in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    num_tokens,
    block_size,
    head_dim,
    row_size,  # num_kv_heads * head_dim
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,  # row_size padded to a power of 2
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    slots = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    blocks = slots // block_size
    in_block = slots % block_size
    heads = offs_r // head_dim
    dims = offs_r % head_dim
    mask = (slots >= 0)[:, None] & (offs_r < row_size)[None, :]

    src_k = offs_t[:, None] * stride_kt + heads[None, :] * stride_kh + dims[None, :] * stride_kd
    src_v = offs_t[:, None] * stride_vt + heads[None, :] * stride_vh + dims[None, :] * stride_vd
    dst_k = (
        blocks[:, None] * stride_kcb
        + in_block[:, None] * stride_kcs
        + heads[None, :] * stride_kch
        + dims[None, :] * stride_kcd
    )
    dst_v = (
        blocks[:, None] * stride_vcb
        + in_block[:, None] * stride_vcs
        + heads[None, :] * stride_vch
        + dims[None, :] * stride_vcd
    )
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter key and value rows into their cache slots in place; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row_size = num_kv_heads * head_dim
    block_r = triton.next_power_of_2(row_size)
    # About 4K elements per program: few programs for the interpreter, small tiles on a GPU.
    block_t = max(1, min(64, 4096 // block_r, triton.next_power_of_2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t),)
    _write_kv_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        k_cache.shape[1],
        head_dim,
        row_size,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
    )
