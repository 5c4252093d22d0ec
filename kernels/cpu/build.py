"""Build the CPU kernels on first use and load them (ctypes).

The C sources beside this file are compiled by the system C compiler (`$CC`, else `cc`, else
`gcc`) with `-O3 -march=native -fopenmp` into one shared library under
`~/.cache/stepscope/kernels/` (or `$STEPSCOPE_CACHE/kernels/`), named by a hash of the sources,
flags, compiler and CPU: a changed kernel, or another machine sharing the cache, builds its
own. Building takes about a second; `make setup` does it once ahead. No Python or torch
headers are involved: the kernels take raw pointers, and ctypes releases the GIL for the call.
They link against the OpenMP runtime torch has already loaded (libgomp.so.1), so the kernels
and torch's own ops share one pool of threads.
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

HERE = Path(__file__).parent
COMMON = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fopenmp",
    "-fPIC",
    "-Werror=implicit-function-declaration",
]
# Each source with its own rounding: attention may fuse multiply-adds (and lets its exponential's
# floor vectorize); the elementwise ops round every product and sum as torch does.
SOURCES = {
    "attention.c": ["-ffp-contract=fast", "-fno-trapping-math"],
    "norm.c": ["-ffp-contract=off"],
    "rotary.c": ["-ffp-contract=off"],
}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    # q, k_cache, v_cache, block_tables, bt_stride, seq_lens, num_seqs, num_heads,
    # num_kv_heads, head_dim, block_size, scale, out, scratch, max_len, num_threads
    "decode_attention": [_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _P, _I, _I],
    # x, residual, weight, eps, out, sum_out, rows, hidden, num_threads
    "rms_norm": [_P, _P, _P, _F, _P, _P, _I, _I, _I],
    # q, q_stride, k, k_stride, positions, cache, max_positions, tokens, num_heads,
    # num_kv_heads, head_dim, q_out, k_out, num_threads
    "rotary": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _P, _P, _I],
}


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded (no compiler, or it failed)."""


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    root = os.environ.get("STEPSCOPE_CACHE") or Path.home() / ".cache" / "stepscope"
    return Path(root) / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError(
            "no C compiler found (set $CC, or install gcc: `apt-get install gcc`); the cpu "
            "attention backend builds its kernels with one (attention_backend='torch' needs none)"
        )
    return cc


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path() -> Path:
    """Where the library for these sources, this compiler and this CPU lives (built or not)."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise KernelBuildError(f"the C compiler {cc} does not run: {e}") from e
    parts = [cc, version, _cpu_flags(), " ".join(COMMON), (HERE / "common.h").read_text()]
    for name, flags in sorted(SOURCES.items()):
        parts += [name, " ".join(flags), (HERE / name).read_text()]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return _cache_dir() / f"stepscope-cpu-{digest}.so"


def build() -> Path:
    """Compile the kernels unless this exact build exists; the shared library's path."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    cc = _compiler()
    # Build in a private folder and rename into place: processes starting together (DP ranks,
    # TP workers) may all build, and none ever loads half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for name, flags in SOURCES.items():
            obj = Path(tmp) / (name + ".o")
            _run([cc, *COMMON, *flags, "-c", str(HERE / name), "-o", str(obj)], name)
            objects.append(str(obj))
        lib = Path(tmp) / "lib.so"
        # --no-undefined: a missing symbol fails here, with the compiler's message, not at load.
        _run([cc, "-shared", "-fopenmp", "-Wl,--no-undefined", *objects, "-o", str(lib)],
             "linking")  # fmt: skip
        os.replace(lib, target)
    return target


def _run(cmd: list[str], what: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise KernelBuildError(f"building the CPU kernels: {what} failed:\n{out.stderr[-4000:]}")


def load() -> ctypes.CDLL:
    """The kernels, loaded once per process (built first if needed)."""
    global _library
    with _lock:
        if _library is None:
            path = build()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                raise KernelBuildError(f"loading {path} failed: {e}") from e
            for name, args in SIGNATURES.items():
                for suffix in ("f32", "bf16"):
                    fn = getattr(lib, f"{name}_{suffix}")
                    fn.argtypes = args
                    fn.restype = ctypes.c_int
            _library = lib
        return _library


def available() -> str | None:
    """None when the kernels build and load here; else why not."""
    try:
        load()
    except KernelBuildError as e:
        return str(e)
    return None


if __name__ == "__main__":  # `python -m stepscope.kernels.cpu.build`: build now (make setup)
    print(f"CPU kernels: {build()}")
