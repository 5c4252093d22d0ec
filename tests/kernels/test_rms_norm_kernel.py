"""RMSNorm kernel against its PyTorch reference, and the reference against transformers."""

import pytest
import torch

from stepscope.kernels.rms_norm import rms_norm, rms_norm_ref


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("hidden", [64, 100, 576])
def test_rms_norm_matches_reference(
    num_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    tol: dict[str, float],
    device: torch.device,
) -> None:
    x = torch.randn(num_tokens, hidden).to(device, dtype)
    weight = torch.randn(hidden).to(device, dtype)

    out = rms_norm(x, weight, 1e-5)

    assert out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-5), **tol)


@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_with_residual_returns_normed_sum_and_sum(
    hidden: int, dtype: torch.dtype, tol: dict[str, float], device: torch.device
) -> None:
    x = torch.randn(9, hidden).to(device, dtype)
    residual = torch.randn(9, hidden).to(device, dtype)
    weight = torch.randn(hidden).to(device, dtype)
    x_before, residual_before = x.clone(), residual.clone()

    out, summed = rms_norm(x, weight, 1e-6, residual=residual)
    out_ref, summed_ref = rms_norm_ref(x, weight, 1e-6, residual=residual)

    torch.testing.assert_close(summed, summed_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, out_ref, **tol)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_reference_matches_transformers_llama_rms_norm() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(96, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(4, 96).to(torch.bfloat16)

    with torch.no_grad():
        expected = norm(x)
        actual = rms_norm_ref(x, norm.weight, 1e-5)

    torch.testing.assert_close(actual, expected, atol=0, rtol=0)
