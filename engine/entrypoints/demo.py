"""`make demo`: the whole system on the default model with a small sample workload.

Starts `stepscope serve` (API server, engine core, worker, trace collector and dashboard), sends
a few chat requests through the official `openai` client, streaming, and shows what came back and
where to look next: the dashboard, /metrics and the trace file.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx

from stepscope.engine.entrypoints.serve import ServerProcess

SAMPLE_CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences what a KV cache is.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? Answer briefly.",
]


async def _workload(url: str, model: str) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="demo")

    async def one(question: str) -> tuple[str, str, float, float]:
        start = time.perf_counter()
        first = None
        parts = []
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=48,
            temperature=0,
            stream=True,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
        end = time.perf_counter()
        return question, "".join(parts), (first or end) - start, end - start

    start = time.perf_counter()
    results = await asyncio.gather(*(one(q) for q in SAMPLE_CHATS))
    elapsed = time.perf_counter() - start
    for question, answer, ttft, e2e in results:
        print(f"\n> {question}\n{answer.strip()}\n  [TTFT {ttft * 1e3:.0f} ms, total {e2e:.1f} s]")
    print(f"\n{len(results)} concurrent streaming requests in {elapsed:.1f} s")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(model: str, port: int = 8000, dashboard_port: int = 5006, wait: bool = True) -> None:
    trace_db = Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.duckdb"
    url = f"http://127.0.0.1:{port}"
    args = ["--model", model, "--trace-db", str(trace_db),
            "--dashboard-port", str(dashboard_port)]  # fmt: skip
    print(f"starting: stepscope serve --port {port} {' '.join(args)}", flush=True)
    # A process manager's SIGTERM or a closed terminal's SIGHUP stops the demo as Ctrl-C does:
    # through the `finally` below, which stops the server and everything it started.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    server = ServerProcess(*args, port=port)
    try:
        asyncio.run(_workload(url, model))
        metrics = httpx.get(f"{url}/metrics").text
        wanted = ("stepscope:generation_tokens_total", "stepscope:prefix_cache_hits_total",
                  "stepscope:num_preemptions_total")  # fmt: skip
        for line in metrics.splitlines():
            if line.startswith(wanted):
                print(" ", line)
        print(f"\nOpenAI API:  {url}/v1   metrics: {url}/metrics")
        print(f"dashboard:   http://127.0.0.1:{dashboard_port}")
        print(f"trace file:  {trace_db} (stepscope trace summary {trace_db}, once stopped)")
        if wait:
            print("\nThe server keeps running: try the dashboard, or send your own requests. "
                  "Ctrl-C stops everything.", flush=True)  # fmt: skip
            server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
