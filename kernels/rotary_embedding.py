"""Rotary position embedding for the worker forward: rotates each token's query and key heads by
its absolute position right after the QKV projection, before keys go into the KV cache.

Llama/NeoX "rotate_half" layout: the two halves of a head are rotated against each other,
out = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). The cache row of a
position holds cos in its first head_dim / 2 columns and sin in the last head_dim / 2.
"""

import torch
import triton
import triton.language as tl


def build_cos_sin_cache(
    max_position: int,
    head_dim: int = 0,
    theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    inv_freq: torch.Tensor | None = None,  # [head_dim / 2]; None: unscaled, from theta
) -> torch.Tensor:  # [max_position, head_dim]
    """Cos and sin of position * inv_freq, computed as transformers' LlamaRotaryEmbedding does."""
    if inv_freq is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (theta**exponents)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def rotary_embedding_ref(positions, q, k, cos_sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding` (same arguments and shapes) in plain PyTorch: rotated copies of q and
    k, computed in float32."""
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(
    out_ptr,  # [num_tokens, heads, head_dim]
    x_ptr,  # [num_tokens, heads, head_dim]
    cos,  # [BLOCK_T, 1, HALF] float32
    sin,  # [BLOCK_T, 1, HALF] float32
    offs_t,  # [BLOCK_T]
    token_mask,  # [BLOCK_T]
    num_heads,
    half,
    stride_ot,
    stride_oh,
    stride_od,
    stride_xt,
    stride_xh,
    stride_xd,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (
        token_mask[:, None, None]
        & (offs_h < num_heads)[None, :, None]
        & (offs_d < half)[None, None, :]
    )
    src = x_ptr + offs_t[:, None, None] * stride_xt + offs_h[None, :, None] * stride_xh
    x1 = tl.load(src + offs_d[None, None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + (offs_d + half)[None, None, :] * stride_xd, mask=mask, other=0.0)
    x2 = x2.to(tl.float32)
    out1 = (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty)
    out2 = (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty)
    dst = out_ptr + offs_t[:, None, None] * stride_ot + offs_h[None, :, None] * stride_oh
    tl.store(dst + offs_d[None, None, :] * stride_od, out1, mask=mask)
    tl.store(dst + (offs_d + half)[None, None, :] * stride_od, out2, mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    q_out_ptr,  # [num_tokens, num_heads, head_dim]
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens] int64
    cos_sin_cache_ptr,  # [max_position, head_dim]
    num_tokens,
    num_heads,
    num_kv_heads,
    half,  # head_dim // 2
    stride_cache,
    stride_qot,
    stride_qoh,
    stride_qod,
    stride_kot,
    stride_koh,
    stride_kod,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    BLOCK_T: tl.constexpr,
    BLOCK_QH: tl.constexpr,  # num_heads padded to a power of 2
    BLOCK_KH: tl.constexpr,  # num_kv_heads padded to a power of 2
    HALF: tl.constexpr,  # half padded to a power of 2
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HALF)
    token_mask = offs_t < num_tokens
    positions = tl.load(positions_ptr + offs_t, mask=token_mask, other=0).to(tl.int64)
    row = cos_sin_cache_ptr + positions[:, None] * stride_cache + offs_d[None, :]
    cs_mask = token_mask[:, None] & (offs_d < half)[None, :]
    cos = tl.load(row, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(row + half, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]

    _rotate_heads(
        q_out_ptr,
        q_ptr,
        cos,
        sin,
        offs_t,
        token_mask,
        num_heads,
        half,
        stride_qot,
        stride_qoh,
        stride_qod,
        stride_qt,
        stride_qh,
        stride_qd,
        BLOCK_QH,
        HALF,
    )
    _rotate_heads(
        k_out_ptr,
        k_ptr,
        cos,
        sin,
        offs_t,
        token_mask,
        num_kv_heads,
        half,
        stride_kot,
        stride_koh,
        stride_kod,
        stride_kt,
        stride_kh,
        stride_kd,
        BLOCK_KH,
        HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # q, k rotated, same shapes
    """Rotated copies of q and k; the inputs are not modified."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 != 0:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dimension")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out

    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_qh = triton.next_power_of_2(num_heads)
    # About 4K query elements per program: few programs for the interpreter.
    block_t = max(1, min(16, 4096 // (block_qh * block_half), triton.next_power_of_2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t),)
    _rotary_embedding_kernel[grid](
        q_out,
        k_out,
        q,
        k,
        positions,
        cos_sin_cache,
        num_tokens,
        num_heads,
        num_kv_heads,
        half,
        cos_sin_cache.stride(0),
        *q_out.stride(),
        *k_out.stride(),
        *q.stride(),
        *k.stride(),
        BLOCK_T=block_t,
        BLOCK_QH=block_qh,
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        HALF=block_half,
    )
    return q_out, k_out
