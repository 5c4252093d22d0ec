"""The CPU kernels (kernels/cpu: C, built with the system compiler) against their references:
decode attention and prefill attention from a paged cache, RMSNorm with and without its
residual add, rotary on q and k read out of a fused QKV row. bfloat16 is emulated where the CPU
lacks it: the kernels widen it to float32 themselves, so both dtypes run on every CPU. And
their one ABI, kernels.h: the definitions, the ctypes signatures and the calls all agree with
it, or fail."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from stepscope.engine.layers.ops import TorchForwardOps
from stepscope.engine.layers.rotary import RopeScaling, rope_inv_freq
from stepscope.kernels.cpu import build, ops

pytestmark = pytest.mark.skipif(
    build.available() is not None, reason=f"no CPU kernels here: {build.available()}"
)
CPU_DTYPES = [torch.float32, torch.bfloat16]
HEADER = (build.HERE / "kernels.h").read_text()


def _paged_context(dtype, lengths, block_size=16, num_kv_heads=3, head_dim=64, shuffle=True):
    """A cache with each request's context in blocks scattered over the pool."""
    blocks_each = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_each) + 7
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    order = torch.randperm(num_blocks) if shuffle else torch.arange(num_blocks)
    table = torch.zeros(len(lengths), max(blocks_each), dtype=torch.int32)
    used = 0
    for i, b in enumerate(blocks_each):
        table[i, :b] = order[used : used + b]
        used += b
    return k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["float32", "bfloat16"])
# head_dim 64 runs the AVX-512 block routines where the CPU has them: groups of 3, 4 and
# 5 query heads (their heads taken 4 at a time, then the rest) and 1, blocks of 16 and 32 keys
# (one or two tiles of 16). The others run the portable loops.
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),
        (8, 2, 64, 16),
        (10, 2, 64, 32),
        (2, 2, 64, 16),
        (4, 4, 128, 16),
        (6, 2, 48, 16),
    ],
)
def test_decode_attention_matches_the_reference(
    dtype, num_heads, num_kv_heads, head_dim, block_size
):
    # Lengths: one token, a partial block, exactly one block, many blocks with a partial end.
    lengths = [1, 7, 16, 17, 300, 1000]
    k_cache, v_cache, table, seq_lens = _paged_context(
        dtype, lengths, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    q = torch.randn(len(lengths), num_heads, head_dim).to(dtype)
    got = ops.decode_attention(q, k_cache, v_cache, table, seq_lens, head_dim**-0.5)
    want = ops.decode_attention_reference(q, k_cache, v_cache, table, seq_lens, head_dim**-0.5)
    tol = {"atol": 2e-6, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # A request of one token attends only to itself: its output is its own value.
    one = v_cache[table[0, 0].long(), 0].float().repeat_interleave(num_heads // num_kv_heads, 0)
    torch.testing.assert_close(got[0].float(), one, atol=1e-6, rtol=0)


def test_decode_attention_uses_this_cpus_vector_units():
    from stepscope.engine.config import cpu_flags

    flags = cpu_flags()
    expected = {"avx512"} if "avx512f" in flags else set()
    if "avx512_bf16" in flags:
        expected.add("avx512_bf16")  # bfloat16 scores by vdpbf16ps, straight from the cache
    assert ops.decode_attention_paths() == expected


def test_portable_build_gives_the_same_bf16_attention(tmp_path):
    """The loops a CPU without AVX-512 runs, built here with it switched off: bfloat16 widened
    to float32 in memory; against the reference, and close to this CPU's own build."""
    portable = build.load_library(build.compile_library(build.HERE, tmp_path, ["-mno-avx512f"]))
    assert ops.decode_attention_paths(portable) == set()
    k_cache, v_cache, table, seq_lens = _paged_context(torch.bfloat16, [5, 16, 40, 333])
    q = torch.randn(4, 9, 64).to(torch.bfloat16)
    got = ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125, library=portable)
    want = ops.decode_attention_reference(q, k_cache, v_cache, table, seq_lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=8e-3, rtol=2e-2)
    native = ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125)
    torch.testing.assert_close(native.float(), got.float(), atol=8e-3, rtol=2e-2)


def test_decode_attention_fills_out_and_refuses_a_context_beyond_max_len():
    k_cache, v_cache, table, seq_lens = _paged_context(torch.float32, [40, 20])
    q = torch.randn(2, 9, 64)
    out = torch.empty_like(q)
    assert ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125, out=out) is out
    with pytest.raises(ValueError, match="between 1 and max_len"):
        ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125, max_len=30)
    with pytest.raises(TypeError, match="int32"):
        ops.decode_attention(q, k_cache, v_cache, table.long(), seq_lens, 0.125)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ops.decode_attention(q.half(), k_cache.half(), v_cache.half(), table, seq_lens, 0.125)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["float32", "bfloat16"])
# head_dim 64 runs the AVX-512 tiles where the CPU has them; 48 the portable loops. Blocks of
# 16 and 32 keys; groups of 3 and 2 query heads, and none.
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 2, 64, 32), (4, 4, 48, 16)],
)
# (context_len, queries): a whole prompt of one token, of a partial work item, of several
# items with a partial end; chunks after a context that ends inside a block and after a long
# one, and a single query after context (a decode, as a prefill).
@pytest.mark.parametrize(
    ("context_len", "num_queries"), [(0, 1), (0, 13), (0, 77), (19, 40), (700, 200), (45, 1)]
)
def test_prefill_attention_matches_the_reference(
    dtype, num_heads, num_kv_heads, head_dim, block_size, context_len, num_queries
):
    k_cache, v_cache, table, _ = _paged_context(
        dtype, [context_len + num_queries], block_size, num_kv_heads, head_dim
    )
    q = torch.randn(num_queries, num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    got = ops.prefill_attention(q, k_cache, v_cache, table[0], context_len, scale)
    want = ops.prefill_attention_reference(q, k_cache, v_cache, table[0], context_len, scale)
    tol = {"atol": 2e-6, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_prefill_attention_portable_build_agrees_and_bad_arguments_are_refused(tmp_path):
    portable = build.load_library(build.compile_library(build.HERE, tmp_path, ["-mno-avx512f"]))
    k_cache, v_cache, table, _ = _paged_context(torch.float32, [130])
    q = torch.randn(50, 9, 64)
    out = torch.empty_like(q)
    got = ops.prefill_attention(q, k_cache, v_cache, table[0], 80, 0.125, out=out, library=portable)
    assert got is out
    want = ops.prefill_attention_reference(q, k_cache, v_cache, table[0], 80, 0.125)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="must hold 150 keys"):  # 9 blocks: 144 keys
        ops.prefill_attention(q, k_cache, v_cache, table[0], 100, 0.125)
    with pytest.raises(ValueError, match="do not group"):
        ops.prefill_attention(torch.randn(50, 8, 64), k_cache, v_cache, table[0], 80, 0.125)


def _null_blocks_before(table, first_keys, block_size, k_cache, v_cache):
    """Each request's blocks wholly before its first key pointed at a block of NaN, as a
    freed block behind a sliding window may be: a kernel that read it would give NaN."""
    k_cache[-1] = v_cache[-1] = float("nan")  # one of _paged_context's 7 spare blocks
    table = table.clone()
    for i, first in enumerate(first_keys):
        table[i, : first // block_size] = k_cache.shape[0] - 1
    return table


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["float32", "bfloat16"])
# 64 runs the AVX-512 routines where the CPU has them (bfloat16 dot products included), 48
# the portable loops.
@pytest.mark.parametrize("head_dim", [64, 48])
def test_windowed_attention_skips_the_blocks_before_the_window(dtype, head_dim):
    window, block_size, lengths = 40, 16, [1, 7, 40, 41, 57, 300]
    k_cache, v_cache, table, seq_lens = _paged_context(
        dtype, lengths, block_size, num_kv_heads=2, head_dim=head_dim, shuffle=False
    )
    tol = {"atol": 2e-6, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 2e-2}
    q = torch.randn(len(lengths), 4, head_dim).to(dtype)
    args = (q, k_cache, v_cache, table, seq_lens, 0.125)
    want = ops.decode_attention_reference(*args, sliding_window=window)
    nulled = _null_blocks_before(
        table, [max(0, n - window) for n in lengths], block_size, k_cache, v_cache
    )
    got = ops.decode_attention(q, k_cache, v_cache, nulled, seq_lens, 0.125, sliding_window=window)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # A chunk straddling the window's edge, after a context the window leaves mostly behind.
    for context_len, num_queries in [(0, 77), (30, 20), (250, 50)]:
        k_cache, v_cache, table, _ = _paged_context(
            dtype, [context_len + num_queries], block_size, 2, head_dim, shuffle=False
        )
        q = torch.randn(num_queries, 4, head_dim).to(dtype)
        args = (q, k_cache, v_cache, table[0], context_len, 0.125)
        want = ops.prefill_attention_reference(*args, sliding_window=window)
        nulled = _null_blocks_before(
            table, [max(0, context_len - window + 1)], block_size, k_cache, v_cache
        )
        got = ops.prefill_attention(*args[:3], nulled[0], *args[4:], sliding_window=window)
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add+norm"])
def test_rms_norm_matches_transformers_op_for_op(dtype, with_residual):
    x = torch.randn(37, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    residual = torch.randn(37, 576).to(dtype) if with_residual else None
    got = ops.rms_norm(x, weight, 1e-5, residual=residual)
    want = ops.rms_norm_reference(x, weight, 1e-5, residual=residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the residual sum, rounded in the dtype
        got, want = got[0], want[0]
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # every rounding where torch rounds
    else:
        # Only the order of the sum of squares differs from torch's: a unit in the last place.
        torch.testing.assert_close(got, want, atol=0, rtol=4e-7)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["float32", "bfloat16"])
def test_rotary_equals_transformers_bit_for_bit_from_a_fused_qkv_row(dtype):
    tokens, heads, kv_heads, dim = 29, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # rows qkv.shape[1] apart
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    inv_freq = rope_inv_freq(dim, 10000.0, RopeScaling())
    cache = TorchForwardOps().rope_cache(2048, inv_freq, torch.device("cpu"), dtype)
    positions = torch.randint(0, 2048, (tokens,))
    got_q, got_k = ops.rotary(positions, q, k, cache)
    want_q, want_k = ops.rotary_reference(positions, q, k, cache)
    assert got_q.is_contiguous() and torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.rotary(torch.tensor([2048] * tokens), q, k, cache)


@pytest.mark.slow  # compiles the library twice (5 s): the fast tier stays under 4 minutes
def test_the_build_is_cached_by_source_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPSCOPE_CACHE", str(tmp_path))
    path = build.build()
    assert path.parent == tmp_path / "kernels" and path.exists()
    stamp = path.stat().st_mtime_ns
    assert build.build() == path and path.stat().st_mtime_ns == stamp  # not rebuilt


def test_a_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.KernelBuildError, match="does not run"):
        build.build()
    monkeypatch.delenv("CC")
    with pytest.raises(build.KernelBuildError, match="no C compiler found"):
        build.library_path()


def _copy_of_sources(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """The kernels' sources in tmp_path/src, with `old` replaced by `new` in `name`."""
    src = tmp_path / "src"
    shutil.copytree(build.HERE, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    text = (src / name).read_text()
    assert old in text
    (src / name).write_text(text.replace(old, new))
    return src


def _definitions(sources: Path) -> dict[str, build.Signature]:
    """The exported kernels as their definitions in `sources` declare them, macros expanded
    (so as the compiler sees them), read like kernels.h."""
    exported = build.signatures(HEADER)
    prototypes = []
    for name, flags in build.SOURCES.items():
        cmd = [build._compiler(), *build.COMMON, *flags, "-E", "-P", str(sources / name)]
        code = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for kernel, params in re.findall(r"\bint\s+(\w+)\s*\(([^()]*)\)\s*\{", code):
            if kernel in exported:
                prototypes.append(f"int {kernel}({params});")
    return build.signatures("\n".join(prototypes))


def test_the_ctypes_signatures_are_kernels_h_argument_by_argument():
    signatures = build.signatures(HEADER)
    kinds = (
        "decode_attention",
        "prefill_attention",
        "rms_norm",
        "rotary",
        "qlinear",
        "decode_layers",
    )
    per_dtype = [f"{k}_{s}" for k in kinds for s in ("f32", "bf16")]
    others = ["decode_attention_paths", "prefill_attention_scratch", "top_k_top_p_f32",
              "qlinear_paths"]  # fmt: skip
    assert sorted(signatures) == sorted([*per_dtype, *others])
    attention = signatures["decode_attention_f32"]
    assert attention.params[10:13] == ("block_size", "scale", "out")
    assert attention.argtypes[10:13] == (ctypes.c_int64, ctypes.c_float, ctypes.c_void_p)
    # One argument drifted in a copy of the header: exactly that one changes in the signature.
    old, new = "float soft_cap, int64_t max_len,", "float soft_cap, float max_len,"
    drifted = build.signatures(HEADER.replace(old, new, 1))["decode_attention_f32"].argtypes
    pairs = zip(attention.params, attention.argtypes, drifted, strict=True)
    assert [name for name, was, now in pairs if was is not now] == ["max_len"]
    # What the parser cannot read is an error, never skipped.
    for broken in (
        ("int64_t rows", "size_t rows"),
        ("float eps,", "float,"),
        ("#endif", "int (*f)(void);"),
    ):
        with pytest.raises(build.KernelBuildError, match="kernels.h"):
            build.signatures(HEADER.replace(*broken))
    kernels = build.load()
    assert kernels.keys() == signatures.keys()
    for name, kernel in kernels.items():
        want = signatures[name]
        assert kernel.params == want.params
        assert (kernel.fn.argtypes, kernel.fn.restype) == (want.argtypes, want.restype)


@pytest.mark.parametrize(
    ("name", "old", "new", "error"),
    [
        # A definition whose types disagree with kernels.h.
        (
            "kernels.h",
            "float scale, float *out",
            "double scale, float *out",
            r"conflicting types for .decode_attention_f32",
        ),
        # An exported function kernels.h does not declare.
        (
            "attention.c",
            "int decode_attention_f32(",
            "int decode_attention_f64(void) { return 0; }\nint decode_attention_f32(",
            r"no previous prototype for .*decode_attention_f64",
        ),
    ],
    ids=["type-drift", "undeclared"],
)
def test_a_definition_that_disagrees_with_kernels_h_does_not_compile(
    tmp_path, name, old, new, error
):
    src = _copy_of_sources(tmp_path, name, old, new)
    with pytest.raises(build.KernelBuildError, match=error):
        build.compile_library(src, tmp_path)


@pytest.mark.slow  # preprocesses every C source (6 s): the fast tier stays under 4 minutes
def test_the_definitions_name_their_parameters_as_kernels_h_does(tmp_path):
    # The compiler checks types, not names, and calls pass their arguments by kernels.h's names.
    assert _definitions(build.HERE) == build.signatures(HEADER)
    # Two arguments of one type swapped in a definition (a macro's, here): it still compiles...
    old, new = "int64_t rows, int64_t hidden", "int64_t hidden, int64_t rows"
    swapped = _copy_of_sources(tmp_path, "norm.c", old, new)
    build.compile_library(swapped, tmp_path)
    # ...and the names tell.
    drifted = _definitions(swapped)["rms_norm_f32"].params
    assert drifted != build.signatures(HEADER)["rms_norm_f32"].params


def test_a_kernel_call_names_every_argument_as_kernels_h_does():
    kernel = build.load()["rms_norm_f32"]
    args = dict.fromkeys(kernel.params, 0)  # refused before the C code could read them
    renamed = {("width" if name == "hidden" else name): v for name, v in args.items()}
    with pytest.raises(
        TypeError, match="rms_norm_f32.. got an unexpected keyword argument 'width'"
    ):
        kernel.call(**renamed)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'eps'"):
        kernel.call(**{name: v for name, v in args.items() if name != "eps"})
    with pytest.raises(TypeError, match="takes 0 positional arguments"):
        kernel.call(*args.values())
