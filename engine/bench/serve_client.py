"""The client side of `stepscope bench serve`: a workload replayed against a running
OpenAI-compatible server over streaming /v1/completions, seen from stages 1 and 10 of the request
path. Closed loop (a fixed number of clients) or open loop (seeded Poisson arrivals); each request
is timed chunk by chunk, and the run is summed up in the numbers `vllm bench serve` prints.
serve.py runs it from the command line, `bench soak` streams through it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import numpy as np

from stepscope.engine.bench.offline import Workload


@dataclass(slots=True)
class RequestResult:
    index: int  # position in the workload
    prompt_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks carrying text


@dataclass(slots=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    p99_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        ms = np.asarray(seconds) * 1000
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


@dataclass(slots=True)
class BenchResult:
    completed: int
    failed: int
    errors: dict[str, int]  # error message -> how many requests failed with it
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # successful requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft: LatencyStats
    tpot: LatencyStats  # per request, excluding the first token
    itl: LatencyStats  # per streamed chunk, over all requests
    e2el: LatencyStats
    concurrency: int | None
    request_rate: float | None
    requests: list[RequestResult]
    # Prompt tokens the server looked up in / found in its prefix cache during the run, from its
    # /metrics; None where the server does not export them. Hits mean prefill was skipped, as
    # when the same seed is replayed against a server that still holds the last run's blocks.
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None


def run_bench_serve(
    url: str,
    workload: Workload,
    concurrency: int | None = None,
    request_rate: float | None = None,
    api_key: str | None = None,
    model: str | None = None,
    seed: int = 0,
    reset_prefix_cache: bool = False,
) -> BenchResult:
    """Replay `workload` against the server at `url` (e.g. http://127.0.0.1:8000).

    `concurrency`: that many clients, each sending its next request when the last one ends.
    `request_rate`: Poisson arrivals at that many requests/s, seeded by `seed`. Neither: every
    request at once. `model` defaults to the first model the server lists. `reset_prefix_cache`:
    empty the server's prefix cache first (after the warm-up request), so that a workload
    replayed against the same server does the same work again. Safe to call from a notebook,
    whose event loop is already running.
    """
    if concurrency is not None and request_rate is not None:
        raise ValueError("give either concurrency or request_rate, not both")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if request_rate is not None and request_rate <= 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    if concurrency is None and request_rate is None:
        concurrency = len(workload.prompts)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    coro = _replay(
        url, headers, workload, concurrency, request_rate, model, seed, reset_prefix_cache
    )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _replay(
    url, headers, workload, concurrency, request_rate, model, seed, reset_prefix_cache
) -> BenchResult:
    async with (
        httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=60.0) as client,
        CompletionStreams(url, headers) as streams,
    ):
        model = model or await served_model(client)
        # One request first, so that connection set-up and first touches are not measured. Its
        # prompt is a reshuffle, so the prefix cache gives the workload nothing from it.
        warm = random.Random(seed + 1).choices(workload.prompts[0], k=16)
        first = await stream_completion(streams, model, 0, warm, 4)
        if not first.success:
            raise ValueError(f"the warm-up request to {url} failed: {first.error}")

        if reset_prefix_cache:
            r = await client.post("/reset_prefix_cache")
            if r.status_code != 200 or r.json().get("reset") is not True:
                raise ValueError(f"{url} did not empty its prefix cache: HTTP {r.status_code}")
        before = await prefix_cache_counters(client)
        start = time.perf_counter()
        if request_rate is None:
            results = await _closed_loop(streams, model, workload, concurrency)
        else:
            results = await _open_loop(streams, model, workload, request_rate, seed)
        duration = time.perf_counter() - start
        after = await prefix_cache_counters(client)
    res = summarize(results, duration, concurrency, request_rate)
    if before and after:
        res.prefix_cache_queries = after[0] - before[0]
        res.prefix_cache_hits = after[1] - before[1]
    return res


async def served_model(client: httpx.AsyncClient) -> str:
    return (await served_model_card(client))["id"]


async def served_model_card(client: httpx.AsyncClient) -> dict:
    """The first model the server lists, as /v1/models describes it (stepscope adds its dtype)."""
    try:
        r = await client.get("/v1/models")
        r.raise_for_status()
        card = r.json()["data"][0]
        card["id"]  # noqa: B018 - a card without an id is no answer
        return card
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot list the models of {client.base_url}: {e!r}") from e


async def prefix_cache_counters(client: httpx.AsyncClient) -> tuple[int, int] | None:
    """(prompt tokens looked up, prompt tokens found) so far, from the server's /metrics."""
    names = ("stepscope:prefix_cache_queries_total", "stepscope:prefix_cache_hits_total")
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    values = {}
    for line in r.text.splitlines() if r.status_code == 200 else []:
        name, _, value = line.partition("{")
        if name in names:
            values[name] = int(float(value.rsplit(" ", 1)[1]))
    return (values[names[0]], values[names[1]]) if len(values) == 2 else None


async def _closed_loop(
    streams: CompletionStreams, model: str, workload: Workload, concurrency: int
) -> list[RequestResult]:
    pending = iter(range(len(workload.prompts)))
    results: list[RequestResult] = []

    async def user() -> None:
        for i in pending:  # the iterator is shared: each index goes to exactly one user
            results.append(
                await stream_completion(
                    streams, model, i, workload.prompts[i], workload.output_lens[i]
                )
            )

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return results


async def _open_loop(
    streams: CompletionStreams, model: str, workload: Workload, rate: float, seed: int
) -> list[RequestResult]:
    rng = random.Random(seed)
    start = time.perf_counter()
    arrival = 0.0
    tasks = []
    for i, prompt in enumerate(workload.prompts):
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        tasks.append(
            asyncio.create_task(
                stream_completion(streams, model, i, prompt, workload.output_lens[i])
            )
        )
        arrival += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


class CompletionStreams:
    """Streamed /v1/completions to one server over one aiohttp session, as an async context.

    A client on the server's own machine takes CPU from the server it measures. aiohttp's C
    parser spends ~40 us per streamed chunk where httpx spent ~110 (7,015 chunks from 48
    streams, on 2 cores), so the streams go through aiohttp and the few other requests of a
    benchmark through httpx.
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.endpoint = url.rstrip("/") + "/v1/completions"
        self.headers = headers
        self.session: aiohttp.ClientSession | None = None  # opened by `async with`

    async def __aenter__(self) -> CompletionStreams:
        # Requests may queue behind a saturated batch for minutes; only connecting must be quick.
        self.session = aiohttp.ClientSession(
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600),
            connector=aiohttp.TCPConnector(limit=0),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()


async def stream_completion(
    streams: CompletionStreams,
    model: str,
    index: int,
    prompt: list[int],
    max_tokens: int,
    sampling: dict[str, Any] | None = None,
) -> RequestResult:
    """One streamed completion, greedy unless `sampling` (more body fields: `temperature`,
    `seed`, ...) says otherwise; every failure is recorded in the result, never raised."""
    body = {
        "model": model,
        "prompt": prompt,  # token ids, so the prompt length is exact
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(sampling or {}),
    }
    res = RequestResult(index, len(prompt))
    chunk_times: list[float] = []
    usage_tokens = None
    done = False
    sent = time.perf_counter()
    try:
        async with await _post(streams, body) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                res.error = f"HTTP {r.status}: {_error_message(text)}"
                return res
            async for raw in r.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {event['error'].get('message', event['error'])}"
                    return res
                # A chunk counts once it carries generated text: some servers (llama.cpp) send
                # one before the first token, which would make every TTFT look instant.
                if any(choice.get("text") for choice in event.get("choices") or ()):
                    chunk_times.append(time.perf_counter())
                if event.get("usage"):
                    usage_tokens = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not done or not chunk_times:
        res.error = "stream ended without [DONE]" if not done else "stream carried no tokens"
        return res
    res.success = True
    res.output_tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    res.ttft_s = chunk_times[0] - sent
    res.e2el_s = chunk_times[-1] - sent
    res.itl_s = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    return res


async def _post(streams: CompletionStreams, body: dict):
    """The response to a POST, sent again once if the pooled connection it went out on had been
    closed by the server before the request was written (llama.cpp's server closes idle
    keep-alive connections): nothing reached the server, so nothing runs twice."""
    try:
        return await streams.session.post(streams.endpoint, json=body)
    except aiohttp.ClientOSError:
        return await streams.session.post(streams.endpoint, json=body)


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]


def summarize(
    results: list[RequestResult],
    duration: float,
    concurrency: int | None,
    request_rate: float | None,
) -> BenchResult:
    results = sorted(results, key=lambda r: r.index)
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    return BenchResult(
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=errors,
        duration_s=duration,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) / duration,
        output_throughput=n_out / duration,
        total_token_throughput=(n_in + n_out) / duration,
        ttft=LatencyStats.of([r.ttft_s for r in ok]),
        tpot=LatencyStats.of(
            [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        ),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl_s]),
        e2el=LatencyStats.of([r.e2el_s for r in ok]),
        concurrency=concurrency,
        request_rate=request_rate,
        requests=results,
    )


def format_result(res: BenchResult) -> str:
    """The result in the layout of `vllm bench serve`."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: float | int | str) -> None:
        if isinstance(value, float):
            lines.append(f"{label:<40} {value:<10.2f}")
        else:
            lines.append(f"{label:<40} {value:<10}")

    row("Successful requests:", res.completed)
    row("Failed requests:", res.failed)
    if res.request_rate is None:
        row("Maximum request concurrency:", res.concurrency)
    else:
        row("Request rate configured (RPS):", res.request_rate)
    row("Benchmark duration (s):", res.duration_s)
    row("Total input tokens:", res.total_input_tokens)
    row("Total generated tokens:", res.total_output_tokens)
    row("Request throughput (req/s):", res.request_throughput)
    row("Output token throughput (tok/s):", res.output_throughput)
    row("Total Token throughput (tok/s):", res.total_token_throughput)
    if res.prefix_cache_queries:
        row(
            "Prefix cache hits / prompt tokens:",
            f"{res.prefix_cache_hits} / {res.total_input_tokens}",
        )
    for title, short, stats in (
        ("Time to First Token", "TTFT", res.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", res.tpot),
        ("Inter-token Latency", "ITL", res.itl),
        ("End-to-end Latency", "E2EL", res.e2el),
    ):
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", stats.mean_ms)
        row(f"Median {short} (ms):", stats.median_ms)
        row(f"P99 {short} (ms):", stats.p99_ms)
    lines.append("=" * 50)
    for message, count in list(res.errors.items())[:5]:
        lines.append(f"failed x{count}: {message}")
    return "\n".join(lines)
