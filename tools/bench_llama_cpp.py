"""stepscope's server beside llama.cpp's, on one workload, one server at a time.

For each server and each concurrency (1, 8, 48 by default), a fresh server is started, the same
48-request workload is streamed to it by `stepscope bench serve`'s client (`run_bench_serve`:
token-id prompts, greedy, ignore_eos, TTFT and ITL counted at chunks that carry text), and the
server is stopped before the next starts, so that no two ever share the cores. The servers, all
on SmolLM2's Q4_1 GGUF and the same thread count:
- `llama.cpp`: llama.cpp's `llama-server`, with as many slots as the concurrency (`-np 1` at
  one stream, as a single user starts it);
- `gguf`: `stepscope serve` with its defaults (the GGUF's blocks as they are, bfloat16
  activations where the CPU runs them, async scheduling);
- `float32`, `bfloat16`: `stepscope serve --quantization none --dtype ...` (dequantized);
- any of them with `-sync` (e.g. `gguf-sync`): the same with `--no-async-scheduling`, one step
  at a time (`-async` spells the default out); with `-uni`, `--executor uni` (the worker inside
  the engine core's process, as vLLM runs a single GPU).
Each row also gives the floor a one-stream decode cannot go under: the weight bytes a token
reads in that format, at the memory bandwidth measured at the start of the run. Prints a
markdown table for docs/benchmarks.md.

    make llama-server                 # once: builds llama.cpp into the stepscope cache
    .venv/bin/python tools/bench_llama_cpp.py [--concurrency 1,8,48] [--only llama.cpp,float32]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx

from stepscope.engine.bench.latency import memory_bandwidth_gbs
from stepscope.engine.bench.offline import make_workload
from stepscope.engine.bench.serve_client import run_bench_serve
from stepscope.engine.models.loader import (
    DEFAULT_MODEL,
    load_config,
    resolve_model,
    smollm2_gguf_path,
)

sys.path.insert(0, os.path.dirname(__file__))
from build_llama_server import binary_path  # noqa: E402

PORT = 8765
THREADS = str(len(os.sched_getaffinity(0)))


def server_command(name: str, concurrency: int) -> tuple[list[str], dict[str, str]]:
    """The command line that serves `name` for `concurrency` streams, and its environment."""
    env = dict(os.environ)
    if name == "llama.cpp":
        llama = binary_path()
        if not llama.exists():
            raise SystemExit(f"{llama} is missing: run `make llama-server` first")
        env["LD_LIBRARY_PATH"] = f"{llama.parent}:{env.get('LD_LIBRARY_PATH', '')}"
        # A slot of 1,024 tokens for each stream.
        slots, context = str(concurrency), str(1024 * concurrency)
        cmd = [str(llama), "-m", str(smollm2_gguf_path()), "-t", THREADS, "-np", slots,
               "-c", context, "--host", "127.0.0.1", "--port", str(PORT)]  # fmt: skip
        return cmd, env
    cmd = [sys.executable, "-m", "stepscope.engine.entrypoints.cli", "serve",
           "--model", DEFAULT_MODEL, "--no-trace", "--port", str(PORT)]  # fmt: skip
    base, *options = name.split("-")
    if base != "gguf":
        cmd += ["--quantization", "none", "--dtype", base]
    for option in options:
        cmd += {
            "async": ["--async-scheduling"],
            "sync": ["--no-async-scheduling"],
            "uni": ["--executor", "uni"],
        }[option]
    return cmd, env


# The weights a decode step reads, by format: every projection and the LM head (tied to the
# embedding), per weight. Q4_1: 20 bytes a block of 32 in the file (llama.cpp reads them so);
# stepscope's gguf: the repacked Q4_1 (16 bytes of nibbles, float32 scale and min: 24 bytes a
# block) and Q8_0 LM head (32 bytes and 8: 40 a block), see engine/layers/quantization.py.
def weight_bytes(name: str, cfg: dict) -> float:
    h, i, layers, v = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                       cfg["vocab_size"])  # fmt: skip
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    name = name.split("-")[0]
    blocks = {"llama.cpp": (20, 34), "gguf": (24, 40)}  # bytes per 32: layers, LM head (Q8_0)
    if name in blocks:
        layer_bytes, head_bytes = blocks[name]
        return (per_layer * layers * layer_bytes + v * h * head_bytes) / 32
    size = {"float32": 4, "bfloat16": 2}[name]
    return (per_layer * layers + v * h) * size


def start(name: str, concurrency: int) -> subprocess.Popen:
    cmd, env = server_command(name, concurrency)
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"{name} did not become healthy in 600 s")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,48")
    parser.add_argument("--only", default="llama.cpp,gguf,bfloat16,float32")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = load_config(resolve_model(DEFAULT_MODEL))
    vocab = cfg["vocab_size"]
    bandwidth = memory_bandwidth_gbs()
    print(f"{THREADS} threads; memory bandwidth (read, 512 MiB): {bandwidth:.1f} GB/s")
    workload = make_workload(args.num_requests, (16, 400), (16, 96), vocab, args.seed)
    print(
        f"workload: {args.num_requests} requests, prompts 16-400, outputs 16-96 "
        f"({workload.num_output_tokens} output tokens), greedy, ignore_eos, seed {args.seed}"
    )
    rows = []
    for name in args.only.split(","):
        for concurrency in map(int, args.concurrency.split(",")):
            proc = start(name, concurrency)
            try:
                res = run_bench_serve(
                    f"http://127.0.0.1:{PORT}", workload, concurrency=concurrency,
                    model=None if name != "llama.cpp" else "smollm2",
                )  # fmt: skip
            finally:
                stop(proc)
            for message, count in res.errors.items():
                print(f"  {name} at {concurrency}: {count} failed: {message}", flush=True)
            floor_ms = weight_bytes(name, cfg) / bandwidth / 1e6
            row = (f"| {name} | {concurrency} | {res.output_throughput:.1f} | "
                   f"{res.ttft.median_ms:.0f} | {res.itl.median_ms:.1f} | {res.tpot.median_ms:.1f} "
                   f"| {floor_ms:.1f} | {res.failed} |")  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    print(
        "\n| server | concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | TPOT p50 ms", end=""
    )
    print(" | weights floor ms/token | failed |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
