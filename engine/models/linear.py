"""The model's matmuls (worker, stage 6): `y = x @ W.T` for every projection and the LM head.

On a CPU with native bfloat16 matmul (AVX512_BF16 or AMX), oneDNN computes a bfloat16 linear
from weights laid out in its own blocked format. Handed a plain [out, in] weight, as `F.linear`
does, it reorders the whole weight on every call: for a decode step of a few tokens that copy
costs more than the product. `OneDNNLinear` reorders each weight once at load, as vLLM's CPU
backend does with its pre-packed oneDNN matmul handlers. Elsewhere (float32, where MKL reads the
plain layout; GPUs) the weights stay as loaded and `F.linear` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """`F.linear` over weights as loaded."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor:  # [out, in]
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class OneDNNLinear(Linear):
    """bfloat16 on CPU: each weight reordered once into oneDNN's layout at load."""

    # The batch-size hint oneDNN picks the packed layout for; every batch size still runs.
    BATCH_HINT = 64

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def make_linear(device: torch.device, dtype: torch.dtype) -> Linear:
    """The packed oneDNN path where it exists (bfloat16 on a CPU that runs it natively)."""
    if (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return OneDNNLinear()
    return Linear()
