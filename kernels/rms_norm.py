"""RMSNorm for the worker forward: the input norm of every decoder layer (fused with the residual
add of the layer before) and the final norm before the LM head.

Numerics follow transformers' LlamaRMSNorm: the variance is taken in float32, the normalized
value is rounded to the input dtype, and only then multiplied by the weight.
"""

import torch
import triton
import triton.language as tl


def rms_norm_ref(x, weight, eps: float, residual=None):
    """`rms_norm` (same arguments and shapes) in plain PyTorch: normed x; with a residual,
    (normed(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    normed = weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden]
    residual_out_ptr,  # [num_tokens, hidden], x + residual; unused without HAS_RESIDUAL
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden]; unused without HAS_RESIDUAL
    weight_ptr,  # [hidden]
    eps,
    num_tokens,
    hidden,
    stride_ot,
    stride_rot,
    stride_xt,
    stride_rt,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hidden padded to a power of 2
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden
    mask = (offs_t < num_tokens)[:, None] & h_mask[None, :]

    x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(
            residual_ptr + offs_t[:, None] * stride_rt + offs_h[None, :], mask=mask, other=0.0
        )
        # Round the sum to the input dtype, as the model's own residual add does.
        x = (x + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + offs_t[:, None] * stride_rot + offs_h[None, :], x, mask=mask)
        x = x.to(tl.float32)

    variance = tl.sum(x * x, axis=1) / hidden
    normed = (x * tl.rsqrt(variance + eps)[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    out = w[None, :] * normed.to(tl.float32)
    tl.store(
        out_ptr + offs_t[:, None] * stride_ot + offs_h[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normed x; with a residual, (normed(x + residual), x + residual). Inputs are not modified."""
    num_tokens, hidden = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows contiguous in the hidden dimension")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else out
    if num_tokens == 0:
        return out if residual is None else (out, residual_out)

    block_h = triton.next_power_of_2(hidden)
    # About 8K elements per program: few programs for the interpreter, one row or more on a GPU.
    block_t = max(1, min(16, 8192 // block_h, triton.next_power_of_2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t),)
    _rms_norm_kernel[grid](
        out,
        residual_out,
        x,
        residual if residual is not None else x,
        weight,
        eps,
        num_tokens,
        hidden,
        out.stride(0),
        residual_out.stride(0),
        x.stride(0),
        residual.stride(0) if residual is not None else x.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
    )
    return out if residual is None else (out, residual_out)
