"""Fixtures for the kernel tests: the Triton interpreter on CPU, the device, dtypes, tolerances."""

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # triton.jit decides between compiling and interpreting when a kernel is defined, so this has
    # to happen before any stepscope.kernels module is imported.
    os.environ["TRITON_INTERPRET"] = "1"

# Only the Triton kernels care; the C kernels (stepscope.kernels.cpu) have no Triton in them.
_imported_early = sorted(
    m
    for m in sys.modules
    if m.startswith("stepscope.kernels.") and not m.startswith("stepscope.kernels.cpu")
)
if not HAS_CUDA and _imported_early:
    raise pytest.UsageError(
        f"{_imported_early} were imported before TRITON_INTERPRET=1 was set; "
        "set it in the environment or in a conftest.py that runs earlier"
    )

DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if HAS_CUDA else [])
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture
def tol(dtype: torch.dtype) -> dict[str, float]:
    """atol and rtol for torch.testing.assert_close at this dtype."""
    return TOLERANCES[dtype]
