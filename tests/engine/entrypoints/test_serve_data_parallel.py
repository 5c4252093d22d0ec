"""`stepscope serve --dp 2`: two engine cores behind a coordinator, over HTTP.

16 concurrent streams are served by both ranks (read back from the trace's `dp_rank`), neither
rank gets more than twice the other's tokens; killing one rank's engine core turns the streams
in flight into errors and /health into 503 within 5 s, and no process outlives the server."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from stepscope.traces.backend.store import TraceStore
from tests.process_tree import pid_alive, wait_pids_gone
from tests.server_utils import Server

pytestmark = pytest.mark.slow  # a DP=2 server, one rank killed

MODEL = "tiny-llama"


def test_dp2_server_balances_streams_and_fails_fast_when_a_rank_dies(tmp_path) -> None:
    db = tmp_path / "dp.duckdb"
    server = Server(
        "--model", MODEL, "--dp", "2", "--num-kv-blocks", "64",
        "--max-num-batched-tokens", "32", "--trace-db", str(db),
    )  # fmt: skip
    try:
        procs = httpx.get(f"{server.url}/processes", timeout=10).json()["data"]
        roles = sorted(p["role"] for p in procs)
        # A + DP + N + coordinator = 1 + 2 + 2 + 1 (the collector is stepscope's own extra).
        assert roles == ["api", "dp_coordinator", "engine_core", "engine_core", "worker", "worker"]
        assert all(pid_alive(p["pid"]) for p in procs)

        def connect() -> openai.AsyncOpenAI:  # one per event loop
            return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def stream(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> int:
            chunks = await client.completions.create(
                model=MODEL, prompt=f"Stream {i}: " + "w " * i, max_tokens=max_tokens,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return sum([1 async for _ in chunks])

        async def burst() -> list[int]:
            client = connect()
            return await asyncio.gather(*(stream(client, i, 12) for i in range(16)))

        assert asyncio.run(burst()) == [12] * 16

        # A rank dies mid-stream: the client sees an error, /health turns 503, within 5 s.
        victim = next(p["pid"] for p in procs if p["role"] == "engine_core" and p["dp_rank"] == 1)

        async def kill_mid_stream() -> tuple[list, float]:
            client = connect()
            tasks = [asyncio.create_task(stream(client, 100 + i, 900)) for i in range(4)]
            await asyncio.sleep(2.0)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, killed

        results, killed = asyncio.run(kill_mid_stream())
        assert any(isinstance(r, Exception) for r in results), results
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - killed < 5.0
            time.sleep(0.1)
        assert time.monotonic() - killed < 5.0
    finally:
        server.stop()
    assert wait_pids_gone([p["pid"] for p in procs]) == []

    store = TraceStore(db, read_only=True)
    try:
        per_rank = store.df(
            "SELECT dp_rank, sum(output_tokens) AS tokens FROM requests "
            "WHERE request_id LIKE 'cmpl-%' AND output_tokens = 12 GROUP BY dp_rank ORDER BY 1"
        )
    finally:
        store.close()
    assert per_rank["dp_rank"].tolist() == [0, 1]
    low, high = sorted(per_rank["tokens"])
    assert low + high == 16 * 12 and high <= 2 * low
