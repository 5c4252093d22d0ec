"""The model's matmuls (worker, stage 6): `y = x @ W.T` for every projection and the LM head.

A plain GEMM call repacks its weight into the library's blocked layout on every call. At decode
sizes (a few to a few dozen tokens) that copy costs as much as the product, so on the CPU each
weight is packed once at load, as vLLM's CPU backend does with its pre-packed matmul handlers:

- bfloat16, on a CPU with native bfloat16 matmul (AVX512_BF16 or AMX): oneDNN's layout
  (`OneDNNLinear`).
- float32, where torch carries oneDNN (x86_64 wheels): oneDNN's layout too. On a CPU with
  AVX512_BF16 and no AMX its float32 products ran 2.4x faster than MKL's packed GEMM at 15
  tokens, 1.7x at 48 and 1.2x at 1,024 (docs/benchmarks.md).
- float32 without oneDNN, where torch ships MKL: MKL's packed GEMM (`cblas_sgemm_pack` once,
  `cblas_sgemm_compute` per call; `MklPackedLinear`), called through ctypes from the MKL inside
  torch's own library; 1.4-2.7x faster than `F.linear` from 8 to 48 tokens on an AMX machine.

Each packed path is checked against `F.linear` once per process before it is picked.

Elsewhere (GPUs, other dtypes, CPUs without these libraries) the weights stay as loaded and
`F.linear` runs.

A GGUF's quantized weights (engine/layers/quantization.py) run through `QuantizedLinear`: the
integer kernel (kernels/cpu/qlinear.c) for a step of up to `quantized_max_tokens` tokens (an
engine option), where the bytes read bound the product; beyond, the same weight dequantized
once at load into the packed dense path above, where FLOPs bound it (docs/benchmarks.md has
the measurement that chose the default).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from stepscope.engine.layers.quantization import QuantizedWeight

logger = logging.getLogger(__name__)


class Linear:
    """`F.linear` over weights as loaded."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor:  # [out, in]
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def works(self) -> bool:
        """float32 products from packed weights equal `F.linear`'s, to float32 rounding, at
        batch sizes unlike the packing hint: the check that makes a packed path safe to pick."""
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(96, 80, generator=gen)
        packed = self.pack(w)
        for m in (1, 7, 64, 300):
            x = torch.randn(m, 80, generator=gen)
            if not torch.allclose(self(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5):
                return False
        return True


class OneDNNLinear(Linear):
    """bfloat16 or float32 on CPU: each weight reordered once into oneDNN's layout at load."""

    # The batch-size hint oneDNN picks the packed layout for; every batch size still runs.
    BATCH_HINT = 64

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


# CBLAS enum values (mkl_cblas.h).
_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
# The batch size MKL is told at packing; B's packed layout does not depend on it (`works`).
_PACK_M = 64


def _load_mkl_sgemm_pack() -> ctypes.CDLL | None:
    """torch's own library, if it carries MKL's packed GEMM (x86_64 builds do; else None)."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        get_size, pack, compute = (
            lib.cblas_sgemm_pack_get_size,
            lib.cblas_sgemm_pack,
            lib.cblas_sgemm_compute,
        )
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [i, i, i, i]
    pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    pack.restype = None
    compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    compute.restype = None
    return lib


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight [out_features, in_features] in MKL's packed layout. MKL's note: the buffer must
    stay where it was packed (the layout holds addresses), so it is never copied or moved."""

    buffer: torch.Tensor  # uint8, MKL's opaque packed layout
    out_features: int
    in_features: int


class MklPackedLinear(Linear):
    """float32 on CPU: each weight packed once into MKL's GEMM layout; the loaded weight is
    dropped, so the model holds one copy."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def pack(self, weight: torch.Tensor) -> PackedWeight:  # [out, in] float32
        n, k = weight.shape
        weight = weight.contiguous()
        size = self._lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_M, n, k)
        buffer = torch.empty(size, dtype=torch.uint8, device=weight.device)
        self._lib.cblas_sgemm_pack(
            _ROW_MAJOR,
            _B_MATRIX,
            _TRANS,
            _PACK_M,
            n,
            k,
            1.0,
            weight.data_ptr(),
            k,
            buffer.data_ptr(),
        )
        return PackedWeight(buffer, n, k)

    def __call__(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        n, k = weight.out_features, weight.in_features
        if x.shape[-1] != k or x.dtype != torch.float32:
            raise ValueError(f"expected float32 inputs of {k} features, got {x.dtype} {x.shape}")
        rows = x.reshape(-1, k).contiguous()
        m = rows.shape[0]
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
        if m:
            self._lib.cblas_sgemm_compute(
                _ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k,
                rows.data_ptr(), k, weight.buffer.data_ptr(), n, 0.0, out.data_ptr(), n,
            )  # fmt: skip
        return out.view(*x.shape[:-1], n)


@functools.cache
def _mkl_packed_linear() -> MklPackedLinear | None:
    """The MKL path, looked for once per process; None where torch lacks it or it disagrees."""
    lib = _load_mkl_sgemm_pack()
    if lib is None:
        return None
    linear = MklPackedLinear(lib)
    if not linear.works():
        logger.warning("MKL's packed GEMM disagrees with F.linear here; using F.linear")
        return None
    return linear


@functools.cache
def _onednn_float32_linear() -> OneDNNLinear | None:
    """oneDNN's float32 path, looked for once per process; None where torch lacks oneDNN or it
    disagrees with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return None
    linear = OneDNNLinear()
    try:
        if linear.works():
            return linear
    except RuntimeError:  # this oneDNN build refuses float32 weights
        pass
    logger.warning("oneDNN's float32 linear disagrees with F.linear or fails here; not using it")
    return None


class QuantizedLinear(Linear):
    """GGUF blocks through the integer kernel for small steps, the dense path for large ones;
    weights that are not quantized (none, in a GGUF's projections) take the dense path."""

    def __init__(self, dense: Linear, dtype: torch.dtype, max_tokens: int | None) -> None:
        self.dense = dense
        self.dtype = dtype
        self.max_tokens = max_tokens

    def pack(self, weight):
        if not isinstance(weight, QuantizedWeight):
            return self.dense.pack(weight)
        from stepscope.kernels.cpu.ops import QLinear

        w = weight
        kernel = QLinear(w.qs, w.scales, w.mins, w.bits, w.block)
        dense = None
        if self.max_tokens is not None:
            dense = self.dense.pack(weight.dequantize().to(self.dtype))
        return replace(weight, kernel=kernel, dense=dense)

    def __call__(self, x: torch.Tensor, weight) -> torch.Tensor:
        if not isinstance(weight, QuantizedWeight):
            return self.dense(x, weight)
        if weight.dense is not None and x.shape[0] > self.max_tokens:
            return self.dense(x, weight.dense)
        return weight.kernel(x)


def make_linear(
    device: torch.device,
    dtype: torch.dtype,
    quantized: bool = False,
    quantized_max_tokens: int | None = None,
) -> Linear:
    """The packed path where one exists: oneDNN for bfloat16 on a CPU that runs it natively,
    oneDNN for float32 where torch carries it (else MKL's packed GEMM); else `F.linear`.
    `quantized`: the weights include GGUF blocks (a CPU only), wrapped in QuantizedLinear,
    which runs steps of more than `quantized_max_tokens` tokens on a dequantized copy."""
    if quantized:
        if device.type != "cpu":
            raise ValueError("quantized GGUF weights run on the CPU only")
        return QuantizedLinear(make_linear(device, dtype), dtype, quantized_max_tokens)
    if device.type != "cpu":
        return Linear()
    if (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return OneDNNLinear()
    if dtype == torch.float32:
        if (onednn := _onednn_float32_linear()) is not None:
            return onednn
        if (mkl := _mkl_packed_linear()) is not None:
            return mkl
    return Linear()
