"""Decode attention on the CPU straight from the paged KV cache: the C kernel beside this file,
built on first use, and its PyTorch reference.

Triton runs on a CPU only through its interpreter, far too slowly to serve, so the CPU path
has its own kernel (as vLLM's CPU backend has C++ ones). It is plain C with OpenMP, compiled
by the system C compiler (`$CC`, else `cc`) with `-O3 -march=native -fopenmp` into
`~/.cache/stepscope/kernels/` (or `$STEPSCOPE_CACHE/kernels/`), named by a hash of its source,
flags, compiler and CPU, so a changed kernel or another machine builds its own. It is called
through ctypes with the tensors' data pointers; ctypes releases the GIL for the call.

`decode_attention` is what the worker calls; `decode_attention_reference` computes the same in
torch (gather each request's context through its block table, softmax, weighted sum).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_suffix(".c")
# -fno-trapping-math and -fno-math-errno let the exponential's floor vectorize; neither changes
# a result. -ffp-contract=fast fuses multiply-adds.
FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-fopenmp",
    "-shared",
    "-fPIC",
]


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded (no compiler, or it failed)."""


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    root = os.environ.get("STEPSCOPE_CACHE") or Path.home() / ".cache" / "stepscope"
    return Path(root) / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError(
            "no C compiler found (set $CC, or install gcc: `apt-get install gcc`); the CPU "
            "decode-attention kernel needs one, or use attention_backend='torch'"
        )
    return cc


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path() -> Path:
    """Where the built kernel for this source, compiler and CPU lives (built or not)."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), cc, version, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"cpu_decode_attention-{digest}.so"


def build() -> Path:
    """Compile the kernel unless this exact build exists; returns the shared library's path."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run(
            [_compiler(), *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise KernelBuildError(f"compiling {SOURCE.name} failed:\n{out.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL:
    """The built kernel, loaded once per process (building it first if needed)."""
    global _library
    with _lock:
        if _library is None:
            path = build()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                raise KernelBuildError(f"loading {path} failed: {e}") from e
            args = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p]
            args += [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
            args += [ctypes.c_int64, ctypes.c_int64]
            for fn in (lib.decode_attention_f32, lib.decode_attention_bf16):
                fn.argtypes = args
                fn.restype = ctypes.c_int
            _library = lib
        return _library


def decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale: float, max_len=None, out=None
):
    """Attention of one query per request over its cached context.

    q [num_seqs, num_heads, head_dim] (float32 or bfloat16, like the caches); k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, >= blocks] int32;
    seq_lens [num_seqs] int32, each request's context length including its query token (whose
    key and value are already in the cache), at most `max_len` (default: their maximum).
    Returns (or fills `out`) [num_seqs, num_heads, head_dim] in q's dtype.
    """
    import torch

    fn = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
    if q.dtype not in fn or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q and the caches must be float32 or bfloat16 alike, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")  # fmt: skip
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")  # fmt: skip
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_tables and seq_lens must be int32")
    tensors = (q, k_cache, v_cache, block_tables, seq_lens)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("every tensor must be contiguous and on the CPU")
    if max_len is None:
        max_len = int(seq_lens.max()) if num_seqs else 1
    threads = torch.get_num_threads()
    # Per thread: scores, query rows and accumulators of every head, and one widened block.
    per_thread = num_heads * (max_len + 2 * head_dim) + block_size * num_kv_heads * head_dim
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor shaped and typed like q")
    status = getattr(load(), fn[q.dtype])(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        scratch.data_ptr(),
        max_len,
        threads,
    )
    if status != 0:
        raise ValueError(
            "every seq_len must be between 1 and max_len"
            if status == 2
            else "the kernel refused these shapes"
        )
    return out


def decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale: float):
    """The same attention in torch, request by request, in float32."""
    import torch

    num_heads, block_size = q.shape[1], k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : -(-length // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:length].float()  # [length, KVH, D]
        v = v_cache[blocks].flatten(0, 1)[:length].float()
        k = k.repeat_interleave(group, dim=1)  # [length, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * scale
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
