"""`stepscope bench sampling`: what sampling costs a server next to the model, from its trace.

It starts `stepscope serve` (traced) on the model, sends `--streams` concurrent sampled chat
streams (temperature 0.8, top-p 0.9 or 0.95, every fourth with top-k 50, every fifth with a
seed), stops the server and sums the trace's `stepscope.sample` spans against its
`stepscope.forward` spans. Side by side in the same run, on logits of the same shape, it times
the sort-based top-k/top-p (`apply_top_k_top_p_sorted`) against the two ways the sampler finds
the kept tokens: torch's partial top-K (other devices) and the CPU kernel (the CPU backend).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names

QUESTIONS = (
    "Write a short poem about the sea.",
    "Explain photosynthesis to a child.",
    "Give me three tips for sleeping better.",
    "Describe a busy market in the morning.",
    "Why is the sky blue?",
    "Tell me a story about a lighthouse keeper.",
    "What makes bread rise?",
    "List some uses of a paperclip.",
)


def stream_params(i: int) -> dict:
    """The sampling fields of stream i, as a chat completion body sets them."""
    body: dict = {"temperature": 0.8, "top_p": 0.9 if i % 2 else 0.95}
    if i % 4 == 0:
        body["top_k"] = 50
    if i % 5 == 0:
        body["seed"] = i
    return body


async def _streams(url: str, model: str, num: int, max_tokens: int) -> list[int]:
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": max_tokens,
            "ignore_eos": True,  # every stream as long: the same work whatever is sampled
            "stream": True,
            "stream_options": {"include_usage": True},
            **stream_params(i),
        }
        tokens = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise ValueError(f"stream {i}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                data = line.removeprefix("data:").strip()
                if line.startswith("data:") and data != "[DONE]":
                    usage = json.loads(data).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return tokens

    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        return await asyncio.gather(*(one(client, i) for i in range(num)))


def span_totals(trace_db: Path) -> dict[str, tuple[int, float]]:
    """Span name -> (count, total seconds) for the worker's forward and sample spans."""
    import duckdb

    with duckdb.connect(str(trace_db), read_only=True) as con:
        rows = con.execute(
            "SELECT name, count(*), sum(end_ns - start_ns) / 1e9 FROM spans "
            "WHERE name IN (?, ?) GROUP BY name",
            [names.FORWARD, names.SAMPLE],
        ).fetchall()
    return {name: (count, seconds) for name, count, seconds in rows}


def time_top_k_top_p(rows: int, vocab: int, repeat: int = 20) -> tuple[float, float, float]:
    """(sorted, torch candidates, CPU kernel) ms per call on [rows, vocab] logits shaped like a
    language model's (a few likely tokens, a long tail), with this benchmark's top-k / top-p
    mix, temperature included."""
    import torch

    from stepscope.engine.worker.sampler import apply_top_k_top_p_sorted, top_k_top_p_candidates
    from stepscope.kernels.cpu import ops

    g = torch.Generator().manual_seed(0)
    # A Zipf-like spread of logits: rank r gets about -1.1 * log(r).
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = -1.1 * ranks.log()[None, :] + 0.3 * torch.randn(rows, vocab, generator=g)
    logits = logits.gather(1, torch.rand(rows, vocab, generator=g).argsort(dim=1)).contiguous()
    params = [SamplingParams(**stream_params(i)) for i in range(rows)]
    temperature = torch.tensor([p.temperature for p in params])
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params])

    def clock(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) / repeat * 1e3

    return (
        clock(lambda: apply_top_k_top_p_sorted(logits / temperature[:, None], top_k, top_p)),
        clock(lambda: top_k_top_p_candidates(logits / temperature[:, None], top_k, top_p)),
        clock(lambda: ops.top_k_top_p(logits, temperature, top_k, top_p)),
    )


def run_bench_sampling(model: str, streams: int, max_tokens: int, dtype: str) -> int:
    from stepscope.engine.entrypoints.serve import ServerProcess

    with tempfile.TemporaryDirectory(prefix="stepscope-bench-sampling-") as tmp:
        trace_db = Path(tmp) / "trace.duckdb"
        print(f"serving {model} ({dtype}), {streams} sampled chat streams of up to "
              f"{max_tokens} tokens", flush=True)  # fmt: skip
        server = ServerProcess("--model", model, "--dtype", dtype, "--trace-db", str(trace_db))
        try:
            start = time.perf_counter()
            tokens = asyncio.run(_streams(server.url, model, streams, max_tokens))
            seconds = time.perf_counter() - start
        finally:
            server.stop()
        totals = span_totals(trace_db)
    if names.FORWARD not in totals or names.SAMPLE not in totals:
        raise ValueError(f"the trace holds no forward or sample spans: {totals}")
    (steps, forward_s), (_, sample_s) = totals[names.FORWARD], totals[names.SAMPLE]
    print(f"{sum(tokens)} tokens in {seconds:.1f} s over {steps} worker steps")
    print(f"forward spans: {forward_s * 1e3:,.0f} ms ({forward_s / steps * 1e3:.2f} ms a step)")
    print(f"sample spans:  {sample_s * 1e3:,.0f} ms ({sample_s / steps * 1e3:.2f} ms a step)")
    print(f"sample / forward: {sample_s / forward_s:.1%}")
    vocab = _vocab_size(model)
    sorted_ms, torch_ms, kernel_ms = time_top_k_top_p(streams, vocab)
    print(f"top-k/top-p of {streams} rows x {vocab}, on a Zipf-shaped row (wider nuclei than a "
          f"real model's): sorted {sorted_ms:.2f} ms, partial top-K {torch_ms:.2f} ms "
          f"({sorted_ms / torch_ms:.1f}x), CPU kernel {kernel_ms:.2f} ms "
          f"({sorted_ms / kernel_ms:.1f}x)")  # fmt: skip
    return 0


def _vocab_size(model: str) -> int:
    from stepscope.engine.models.loader import load_config, resolve_model

    return load_config(resolve_model(model))["vocab_size"]
