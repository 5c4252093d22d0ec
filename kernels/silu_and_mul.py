"""SiLU-and-mul for the worker forward: the activation of each decoder layer's MLP, between the
fused gate/up projection and the down projection: silu(gate) * up.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def silu_and_mul_ref(
    x: torch.Tensor,  # [num_tokens, 2 * intermediate], gate then up
) -> torch.Tensor:  # [num_tokens, intermediate]
    """silu(gate) * up in x's dtype, as transformers' LlamaMLP computes it."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_tokens, intermediate]
    x_ptr,  # [num_tokens, 2 * intermediate]
    num_tokens,
    intermediate,
    stride_ot,
    stride_xt,
    BLOCK_T: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (offs_t < num_tokens)[:, None] & (offs_i < intermediate)[None, :]
    gate_ptrs = x_ptr + offs_t[:, None] * stride_xt + offs_i[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + intermediate, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as the two torch ops do.
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    out = (act * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_i[None, :], out, mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * intermediate], gate then up
) -> torch.Tensor:  # [num_tokens, intermediate]
    """silu(gate) * up, computed in float32 and rounded like the torch reference."""
    num_tokens, double = x.shape
    if double % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {double}")
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul needs rows contiguous in the last dimension")
    intermediate = double // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out

    block_i = min(1024, triton.next_power_of_2(intermediate))
    # About 8K elements per program: few programs for the interpreter.
    block_t = max(1, min(64, 8192 // block_i, triton.next_power_of_2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(intermediate, block_i))
    _silu_and_mul_kernel[grid](
        out,
        x,
        num_tokens,
        intermediate,
        out.stride(0),
        x.stride(0),
        BLOCK_T=block_t,
        BLOCK_I=block_i,
    )
    return out
