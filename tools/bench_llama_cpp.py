"""stepscope's server beside llama.cpp's, on one workload, one server at a time.

For each server (llama.cpp's `llama-server` on SmolLM2's Q4_1 GGUF, `stepscope serve` in float32
and in bfloat16) and each concurrency (1, 8, 48 by default), a fresh server is started, the same
48-request workload is streamed to it by `stepscope bench serve`'s client (`run_bench_serve`:
token-id prompts, greedy, ignore_eos, TTFT and ITL counted at chunks that carry text), and the
server is stopped before the next starts, so that no two ever share the cores. Prints a
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


def server_command(name: str) -> tuple[list[str], dict[str, str]]:
    """The command line that serves `name`, and its environment."""
    env = dict(os.environ)
    if name == "llama.cpp":
        llama = binary_path()
        if not llama.exists():
            raise SystemExit(f"{llama} is missing: run `make llama-server` first")
        env["LD_LIBRARY_PATH"] = f"{llama.parent}:{env.get('LD_LIBRARY_PATH', '')}"
        # 48 slots of 1,024 tokens: every request of the workload has its own.
        cmd = [str(llama), "-m", str(smollm2_gguf_path()), "-t", THREADS, "-np", "48",
               "-c", "49152", "--host", "127.0.0.1", "--port", str(PORT)]  # fmt: skip
        return cmd, env
    cmd = [sys.executable, "-m", "stepscope.engine.entrypoints.cli", "serve",
           "--model", DEFAULT_MODEL, "--dtype", name, "--no-trace", "--executor", "uni",
           "--port", str(PORT)]  # fmt: skip
    return cmd, env


def start(name: str) -> subprocess.Popen:
    cmd, env = server_command(name)
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
    parser.add_argument("--only", default="llama.cpp,float32,bfloat16")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    vocab = load_config(resolve_model(DEFAULT_MODEL))["vocab_size"]
    workload = make_workload(args.num_requests, (16, 400), (16, 96), vocab, args.seed)
    print(
        f"workload: {args.num_requests} requests, prompts 16-400, outputs 16-96 "
        f"({workload.num_output_tokens} output tokens), greedy, ignore_eos, seed {args.seed}"
    )
    rows = []
    for name in args.only.split(","):
        for concurrency in map(int, args.concurrency.split(",")):
            proc = start(name)
            try:
                res = run_bench_serve(
                    f"http://127.0.0.1:{PORT}", workload, concurrency=concurrency,
                    model=None if name != "llama.cpp" else "smollm2",
                )  # fmt: skip
            finally:
                stop(proc)
            row = (f"| {name} | {concurrency} | {res.output_throughput:.1f} | "
                   f"{res.ttft.median_ms:.0f} | {res.itl.median_ms:.1f} | {res.tpot.median_ms:.1f} "
                   f"| {res.failed} |")  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    print(
        "\n| server | concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | TPOT p50 ms", end=""
    )
    print(" | failed |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
