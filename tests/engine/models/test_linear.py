"""The model's linear op: oneDNN-packed bfloat16 weights compute what `F.linear` computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepscope.engine.models.linear import Linear, OneDNNLinear, make_linear

CPU = torch.device("cpu")


def test_float32_keeps_the_weights_as_loaded() -> None:
    linear = make_linear(CPU, torch.float32)
    w = torch.randn(8, 4)
    assert type(linear) is Linear and linear.pack(w) is w


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bfloat16 on this CPU"
)
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_packed_bfloat16_linear_equals_f_linear(m: int) -> None:
    linear = make_linear(CPU, torch.bfloat16)
    assert isinstance(linear, OneDNNLinear)
    torch.manual_seed(m)
    w = torch.randn(3072, 576, dtype=torch.bfloat16)
    x = torch.randn(m, 576, dtype=torch.bfloat16)
    got = linear(x, linear.pack(w))
    reference = F.linear(x.float(), w.float())
    assert got.shape == (m, 3072) and got.dtype == torch.bfloat16
    # Both accumulate in float32 and round once to bfloat16: within one bfloat16 ulp (2^-8
    # relative) of the exact product, plus float32 summation-order noise.
    assert torch.allclose(got.float(), reference, rtol=2**-7, atol=1e-2)
    assert torch.allclose(got.float(), F.linear(x, w).float(), rtol=2**-7, atol=1e-2)
