"""The quantized kernel of this checkout beside the same kernel at another commit, side by side.

Builds kernels/cpu/ as it is here and as it was at `--against` (a git revision) into two
libraries, then times, in alternating rounds, what one SmolLM2 decode token asks of
`qlinear_bf16`: the 120 projections of its 30 layers (fused qkv 960 x 576, o 576 x 576, fused
gate/up 3072 x 576, down 576 x 1536; 4-bit blocks of 32, as its Q4_1 repacks) and then the LM
head (49152 x 576, 8-bit blocks of 32, as its Q8_0), each weight its own random tensor so that
every one is read from memory, as in a real step, one token, 2 threads. The kernels are called
through ctypes with their pointers, no torch op in between; the engine's own one-token number is
`stepscope bench latency --breakdown`. Prints the medians and the ratio.

    .venv/bin/python tools/bench_qlinear.py --against 8acdefc
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from stepscope.kernels.cpu import build

LAYERS = 30
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of a layer
LM_HEAD = (49152, 576)


def sources_at(revision: str, into: Path) -> Path:
    """kernels/cpu/'s C sources and headers as they were at `revision`."""
    into.mkdir()
    root = Path(build.HERE).resolve().parents[1]
    listing = subprocess.run(
        ["git", "-C", str(root), "ls-tree", "--name-only", revision, "kernels/cpu/"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for path in listing:
        if path.endswith((".c", ".h")):
            text = subprocess.run(
                ["git", "-C", str(root), "show", f"{revision}:{path}"],
                capture_output=True, check=True,
            ).stdout  # fmt: skip
            (into / Path(path).name).write_bytes(text)
    return into


def weight(rows: int, cols: int, bits: int, keep: list) -> tuple:
    """A random weight of `bits`-bit blocks of 32, an input token and an output; the raw
    arguments of one `qlinear_bf16` call (the tensors kept alive in `keep`)."""
    qs = torch.randint(0, 256, (rows, cols * bits // 8), dtype=torch.uint8)
    scales, mins = torch.rand(rows, cols // 32), torch.rand(rows, cols // 32)
    x, out = torch.randn(1, cols, dtype=torch.bfloat16), torch.empty(1, rows, dtype=torch.bfloat16)
    keep.append((qs, scales, mins, x, out))
    pointers = (qs.data_ptr(), scales.data_ptr(), mins.data_ptr())
    return (x.data_ptr(), 1, cols, *pointers, rows, bits, 32, out.data_ptr(), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="a git revision, e.g. HEAD~1")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        old_src = sources_at(args.against, Path(tmp, "src"))
        (Path(tmp, "old")).mkdir()
        (Path(tmp, "new")).mkdir()
        compile_into = build.compile_library
        libraries = {
            args.against: build.load_library(compile_into(old_src, Path(tmp, "old"))),
            "this checkout": build.load_library(compile_into(build.HERE, Path(tmp, "new"))),
        }
        keep: list = []
        layers = [weight(n, k, 4, keep) for _ in range(LAYERS) for n, k in PROJECTIONS]
        head = weight(*LM_HEAD, 8, keep)
        times = {name: ([], []) for name in libraries}
        for _ in range(args.rounds):
            for name, library in libraries.items():
                kernel = library["qlinear_bf16"].fn
                for i in range(13):  # 3 to warm up, 10 timed
                    start = time.perf_counter()
                    for call in layers:
                        kernel(*call)
                    middle = time.perf_counter()
                    kernel(*head)
                    if i >= 3:
                        times[name][0].append(middle - start)
                        times[name][1].append(time.perf_counter() - middle)
    print(f"one SmolLM2 token's quantized products, 2 threads, medians of {10 * args.rounds}:")
    medians = {}
    for name, (layer_times, head_times) in times.items():
        medians[name] = statistics.median(layer_times), statistics.median(head_times)
        print(
            f"  {name:>14}: {LAYERS * len(PROJECTIONS)} layer projections "
            f"{medians[name][0] * 1e3:.2f} ms, LM head after them {medians[name][1] * 1e3:.2f} ms"
        )
    (old_layers, old_head), (new_layers, new_head) = medians.values()
    print(f"ratio this checkout / {args.against}: layers {new_layers / old_layers:.2f}x, "
          f"LM head {new_head / old_head:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
