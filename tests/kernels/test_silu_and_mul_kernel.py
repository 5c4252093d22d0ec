"""SiLU-and-mul kernel against its PyTorch reference."""

import pytest
import torch

from stepscope.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("intermediate", [64, 100, 1536])
def test_silu_and_mul_matches_reference(
    num_tokens: int,
    intermediate: int,
    dtype: torch.dtype,
    tol: dict[str, float],
    device: torch.device,
) -> None:
    x = (3 * torch.randn(num_tokens, 2 * intermediate)).to(device, dtype)

    out = silu_and_mul(x)

    assert out.shape == (num_tokens, intermediate)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **tol)
