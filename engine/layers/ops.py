"""The forward's ops other than attention (worker forward, stage 6): RMSNorm (with the residual
add before it), rotary embedding and SiLU-and-mul, one set per attention backend.

- `TorchForwardOps`: torch ops, op for op as transformers' Llama computes them.
- `CpuForwardOps`: RMSNorm and rotary as C kernels (stepscope.kernels.cpu), the rest as torch.
- `TritonForwardOps`: the Triton kernels in stepscope.kernels.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


class ForwardOps(ABC):
    """The forward's norms, rotary and activation, chosen with the attention backend."""

    @abstractmethod
    def rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """RMSNorm of x, as transformers' LlamaRMSNorm computes it."""

    @abstractmethod
    def add_rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor,  # [num_tokens, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed(x + residual), x + residual
        """The residual add, then RMSNorm of the sum."""

    @abstractmethod
    def rope_cache(
        self,
        max_positions: int,
        inv_freq: torch.Tensor,  # [head_dim / 2] float32, from layers/rotary.py
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # [max_positions, ...], what `rotary` reads by position
        """Cos and sin of every position, in the layout `rotary` takes."""

    @abstractmethod
    def rotary(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cache: torch.Tensor,  # from rope_cache
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q, k rotated
        """Rotary embedding of q and k by each token's position (rotate_half layout)."""

    @abstractmethod
    def silu_and_mul(
        self,
        x: torch.Tensor,  # [num_tokens, 2 * intermediate], gate then up
    ) -> torch.Tensor:  # [num_tokens, intermediate]
        """silu(gate) * up."""


class TorchForwardOps(ForwardOps):
    """Plain torch ops in the model's dtype, op for op as transformers' Llama computes them."""

    def rms_norm(self, x, weight, eps):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps):
        x = x + residual
        return self.rms_norm(x, weight, eps), x

    def rope_cache(self, max_positions, inv_freq, device, dtype):
        # Computed in float32, then cast to the model's dtype, as transformers does; each row is
        # cos then sin, both over the full head_dim.
        t = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        emb = torch.outer(t, inv_freq).repeat(1, 2)
        return torch.cat([emb.cos(), emb.sin()], dim=-1).to(device=device, dtype=dtype)

    def rotary(self, positions, q, k, cache):
        cos, sin = cache[positions][:, None, :].chunk(2, dim=-1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one activation-sized buffer fewer per layer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CpuForwardOps(TorchForwardOps):
    """RMSNorm with its residual add, and rotary, as one C kernel call each (float32 and
    bfloat16 on the CPU; anything else falls back to the torch ops). SiLU-and-mul stays in
    torch: it is bound by memory, and a C version gained little (docs/benchmarks.md)."""

    def __init__(self) -> None:
        from stepscope.kernels.cpu import ops

        self._ops = ops

    @staticmethod
    def _fits(*tensors: torch.Tensor) -> bool:
        return all(
            t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) for t in tensors
        )

    def rms_norm(self, x, weight, eps):
        if not (self._fits(x) and x.is_contiguous() and x.dim() == 2):
            return super().rms_norm(x, weight, eps)
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if not (self._fits(x) and x.is_contiguous() and residual.is_contiguous() and x.dim() == 2):
            return super().add_rms_norm(x, residual, weight, eps)
        return self._ops.rms_norm(x, weight, eps, residual=residual)

    def rotary(self, positions, q, k, cache):
        if not self._fits(q):
            return super().rotary(positions, q, k, cache)
        return self._ops.rotary(positions, q, k, cache)


class TritonForwardOps(ForwardOps):
    """The Triton kernels; RMSNorm takes the residual add into the same launch."""

    def __init__(self) -> None:
        from stepscope.kernels.rms_norm import rms_norm
        from stepscope.kernels.rotary_embedding import build_cos_sin_cache, rotary_embedding
        from stepscope.kernels.silu_and_mul import silu_and_mul

        self._rms_norm = rms_norm
        self._cos_sin_cache = build_cos_sin_cache
        self._rotary = rotary_embedding
        self._silu_and_mul = silu_and_mul

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self._rms_norm(x, weight, eps, residual=residual)

    def rope_cache(self, max_positions, inv_freq, device, dtype):
        # Kept in float32: the kernel rotates in float32 whatever the model's dtype.
        return self._cos_sin_cache(max_positions, inv_freq=inv_freq).to(device)

    def rotary(self, positions, q, k, cache):
        return self._rotary(positions, q, k, cache)

    def silu_and_mul(self, x):
        return self._silu_and_mul(x)
