"""Build the CPU kernels on first use and load them (ctypes).

The C sources beside this file are compiled by the system C compiler (`$CC`, else `cc`, else
`gcc`) with `-O3 -march=native -fopenmp` into one shared library under
`~/.cache/stepscope/kernels/` (or `$STEPSCOPE_CACHE/kernels/`), named by a hash of the sources,
flags, compiler and CPU: a changed kernel, or another machine sharing the cache, builds its
own. Building takes about a second; `make setup` does it once ahead. No Python or torch
headers are involved: the kernels take raw pointers, and ctypes releases the GIL for the call.
Their prototypes are in `kernels.h`, the one statement of their arguments: the compiler checks
each definition against it, and `load` reads it for the ctypes signatures and the parameter
names every call passes its arguments by. They link against the OpenMP runtime torch has
already loaded (libgomp.so.1), so the kernels and torch's own ops share one pool of threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
HEADERS = ["common.h", "kernels.h"]
COMMON = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fopenmp",
    "-fPIC",
    # A definition that disagrees with kernels.h is an error in C already ("conflicting types");
    # these make the rest errors too: an exported function missing from kernels.h, a call or
    # initialiser that mixes up pointers and integers.
    "-Werror=implicit-function-declaration",
    "-Werror=missing-prototypes",
    "-Werror=int-conversion",
    "-Werror=incompatible-pointer-types",
]
# Each source with its own rounding: attention may fuse multiply-adds (and lets its exponential's
# floor vectorize); the elementwise ops round every product and sum as torch does, and so does
# the sampler's (whose exponential vectorizes too).
SOURCES = {
    "attention.c": ["-ffp-contract=fast", "-fno-trapping-math"],
    "prefill_attention.c": ["-ffp-contract=fast", "-fno-trapping-math"],
    "qlinear.c": ["-ffp-contract=fast", "-fno-trapping-math"],
    "decode_layers.c": ["-ffp-contract=off"],
    "norm.c": ["-ffp-contract=off"],
    "rotary.c": ["-ffp-contract=off"],
    "sampling.c": ["-ffp-contract=off", "-fno-trapping-math"],
}


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded (no compiler, or it failed)."""


# kernels.h's C types as ctypes passes them: pointers as addresses, values by their width.
_POINTEES = ("float", "uint16_t", "uint8_t", "int32_t", "int64_t")
_VALUES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"\s*(\w+)\s+(\w+)\s*\(([^()]*)\)\s*")
_PARAMETER = re.compile(r"\s*(?:const\s+)?(\w+)(?:\s*(\*)\s*|\s+)(\w+)\s*")


@dataclass(frozen=True, slots=True)
class Signature:
    """One exported kernel as kernels.h declares it."""

    params: tuple[str, ...]
    argtypes: tuple[type, ...]
    restype: type


def signatures(header: str) -> dict[str, Signature]:
    """The prototypes in kernels.h's text, by function name. Strict, so that it never skips
    what it does not understand: a statement that is not a prototype, or a type outside the
    few above, is an error."""
    code = re.sub(r"/\*.*?\*/", " ", header, flags=re.DOTALL)
    code = re.sub(r"^\s*#.*$", " ", code, flags=re.MULTILINE)
    *statements, rest = code.split(";")
    if rest.strip():
        raise KernelBuildError(f"kernels.h: {' '.join(rest.split())!r} is not a prototype")
    found: dict[str, Signature] = {}
    for statement in statements:
        prototype = _PROTOTYPE.fullmatch(statement)
        if prototype is None or prototype[2] in found:
            raise KernelBuildError(
                f"kernels.h: {' '.join(statement.split())!r} is not a prototype, or a second one"
            )
        restype, name, params = prototype.groups()
        names, argtypes = [], []
        for param in params.split(","):
            parsed = _PARAMETER.fullmatch(param)
            if parsed is None:
                raise KernelBuildError(f"kernels.h: {name}: cannot read {param.strip()!r}")
            c_type, pointer, param_name = parsed.groups()
            argtypes.append(_ctype(name, c_type, pointer == "*"))
            names.append(param_name)
        found[name] = Signature(tuple(names), tuple(argtypes), _ctype(name, restype, False))
    return found


def _ctype(kernel: str, c_type: str, pointer: bool) -> type:
    if pointer and c_type in _POINTEES:
        return ctypes.c_void_p
    if not pointer and c_type in _VALUES:
        return _VALUES[c_type]
    raise KernelBuildError(f"kernels.h: {kernel}: no ctypes type for {c_type}{' *' * pointer}")


@dataclass(frozen=True, slots=True)
class Kernel:
    """A loaded kernel: its ctypes function, typed as kernels.h declares it, and `call`, the
    same taking its arguments only by kernels.h's names (`call(q=..., k_cache=..., ...)`)."""

    fn: Callable[..., int]
    params: tuple[str, ...]
    call: Callable[..., int]


def _by_name(name: str, fn: Callable[..., int], params: tuple[str, ...]) -> Callable[..., int]:
    """fn with keyword-only parameters named `params`, so that Python's own argument check
    refuses a call that misses, adds or misnames one before the C code reads anything; as
    `dataclasses` writes its methods, for the cost of one plain Python call (a **kwargs
    wrapper that checked the names itself cost several microseconds a call)."""
    args = ", ".join(params)
    namespace = {"fn": fn}
    exec(f"def {name}(*, {args}):\n    return fn({args})\n", namespace)
    return namespace[name]


_lock = threading.Lock()
_kernels: dict[str, Kernel] | None = None


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
    parts = [cc, version, _cpu_flags(), " ".join(COMMON)]
    parts += [(HERE / name).read_text() for name in HEADERS]
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
    # Build in a private folder and rename into place: processes starting together (DP ranks,
    # TP workers) may all build, and none ever loads half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        os.replace(compile_library(HERE, Path(tmp)), target)
    return target


def compile_library(sources: Path, out_dir: Path, extra_flags: Sequence[str] = ()) -> Path:
    """Compile the kernel sources in `sources` (this folder, or a test's altered copy of it) and
    link them into a shared library in `out_dir`; its path. `extra_flags` follow the others
    (a test's `-mno-avx512f` builds the portable loops on a CPU that has AVX-512)."""
    cc = _compiler()
    objects = []
    for name, flags in SOURCES.items():
        obj = out_dir / (name + ".o")
        _run([cc, *COMMON, *flags, *extra_flags, "-c", str(sources / name), "-o", str(obj)], name)
        objects.append(str(obj))
    lib = out_dir / "lib.so"
    # --no-undefined: a missing symbol fails here, with the compiler's message, not at load.
    _run(
        [cc, "-shared", "-fopenmp", "-Wl,--no-undefined", *objects, "-lm", "-o", str(lib)],
        "linking",
    )
    return lib


def _run(cmd: list[str], what: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise KernelBuildError(f"building the CPU kernels: {what} failed:\n{out.stderr[-4000:]}")


def load() -> dict[str, Kernel]:
    """The kernels by name, typed as kernels.h declares them; loaded once per process (built
    first if needed)."""
    global _kernels
    with _lock:
        if _kernels is None:
            _kernels = load_library(build())
        return _kernels


def load_library(path: Path) -> dict[str, Kernel]:
    """The kernels of the shared library at `path` (this build's, or a test's other build)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}") from e
    kernels = {}
    for name, signature in signatures((HERE / "kernels.h").read_text()).items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise KernelBuildError(f"{path} has no {name}, which kernels.h declares")
        fn.argtypes, fn.restype = signature.argtypes, signature.restype
        call = _by_name(name, fn, signature.params)
        kernels[name] = Kernel(fn, signature.params, call)
    return kernels


def available() -> str | None:
    """None when the kernels build and load here; else why not."""
    try:
        load()
    except KernelBuildError as e:
        return str(e)
    return None


if __name__ == "__main__":  # `python -m stepscope.kernels.cpu.build`: build now (make setup)
    print(f"CPU kernels: {build()}")
