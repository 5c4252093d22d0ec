"""The model's linear op: packed weights (oneDNN bfloat16 and float32, MKL float32) compute what
`F.linear` computes."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from stepscope.engine.models.linear import (
    Linear,
    MklPackedLinear,
    OneDNNLinear,
    PackedWeight,
    _mkl_packed_linear,
    make_linear,
)

CPU = torch.device("cpu")
X86 = platform.system() == "Linux" and platform.machine() == "x86_64"


def test_float32_packs_with_onednn_where_torch_carries_it() -> None:
    linear = make_linear(CPU, torch.float32)
    if X86:  # torch's x86_64 Linux wheels carry oneDNN: the packed path must be found, not skipped
        assert isinstance(linear, OneDNNLinear)
    if isinstance(linear, OneDNNLinear):
        w = torch.randn(8, 4)
        assert linear.pack(w) is not w and linear.works()
    elif isinstance(linear, MklPackedLinear):
        packed = linear.pack(torch.randn(8, 4))
        assert isinstance(packed, PackedWeight)
        assert (packed.out_features, packed.in_features) == (8, 4)
    else:
        w = torch.randn(8, 4)
        assert type(linear) is Linear and linear.pack(w) is w


@pytest.mark.parametrize("m", [0, 1, 7, 48, 300, 1024])
def test_onednn_float32_linear_equals_f_linear(m: int) -> None:
    linear = make_linear(CPU, torch.float32)
    if not isinstance(linear, OneDNNLinear):
        pytest.skip("this torch carries no oneDNN")
    torch.manual_seed(m)
    w = torch.randn(3072, 576)
    x = torch.randn(m, 576)
    got = linear(x, linear.pack(w))
    assert got.shape == (m, 3072) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_other_dtypes_and_devices_keep_the_weights_as_loaded() -> None:
    w = torch.randn(8, 4, dtype=torch.float16)
    linear = make_linear(CPU, torch.float16)
    assert type(linear) is Linear and linear.pack(w) is w
    assert type(make_linear(torch.device("meta"), torch.float32)) is Linear


def _mkl() -> MklPackedLinear:
    linear = _mkl_packed_linear()
    if linear is None:
        pytest.skip("this torch carries no MKL packed GEMM")
    return linear


# Batch sizes around the packing hint (64) and a prefill step's; 0 is an empty batch.
@pytest.mark.parametrize("m", [0, 1, 7, 48, 64, 300, 1024])
def test_mkl_packed_float32_linear_equals_f_linear(m: int) -> None:
    linear = _mkl()
    torch.manual_seed(m)
    w = torch.randn(3072, 576)
    x = torch.randn(m, 576)
    got = linear(x, linear.pack(w))
    want = F.linear(x, w)
    assert got.shape == (m, 3072) and got.dtype == torch.float32
    # The same products summed in another order: float32 rounding apart, nothing more.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_mkl_packed_linear_takes_leading_dimensions_and_strided_rows() -> None:
    linear = _mkl()
    w = torch.randn(96, 80)
    packed = linear.pack(w.t().contiguous().t())  # a transposed view packs like the weight
    x = torch.randn(2, 5, 160)[..., ::2]  # not contiguous
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_mkl_packed_linear_rejects_inputs_it_cannot_multiply() -> None:
    linear = _mkl()
    packed = linear.pack(torch.randn(96, 80))
    with pytest.raises(ValueError, match="80 features"):
        linear(torch.randn(3, 81), packed)
    with pytest.raises(ValueError, match="float32"):
        linear(torch.randn(3, 80, dtype=torch.float64), packed)


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
