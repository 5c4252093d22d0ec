"""`stepscope trace explain`: why a request was slow, on runs made slow on purpose.

Each scenario runs the real engine and reads its own trace: requests held back by max_num_seqs,
a pool so small that requests are preempted, and a short request that reaches a server while a
long prompt is being prefilled in chunks. In every run, every request's parts add up to its
end-to-end time.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import pytest

from stepscope.engine import LLM, SamplingParams
from stepscope.traces.backend.explain import PARTS, explain, largest_part, slowest
from stepscope.traces.backend.store import TraceStore
from tests.server_utils import CLI, Server

KEYS = {"request_id", "e2e_s", "parts", "queue_reasons", "shared", "cpu", "preemptions",
        "recomputed_tokens", "prefix_hit_tokens", "dp_rank", "startup", "summary"}  # fmt: skip


def offline_trace(path: str, prompts: list[str], max_tokens: list[int], **engine: object) -> None:
    llm = LLM(model="tiny-llama", trace_db=path, **engine)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()


def assert_parts_add_up(store: TraceStore) -> list[dict]:
    results = slowest(store, 1000)
    assert len(results) == len(store.df("SELECT * FROM requests"))
    for r in results:
        assert set(r) == KEYS and set(r["parts"]) == set(PARTS)
        assert all(v >= 0 for v in r["parts"].values()), r["parts"]
        assert sum(r["parts"].values()) == pytest.approx(r["e2e_s"], rel=0.01), r["request_id"]
        assert sum(r["queue_reasons"].values()) == pytest.approx(
            r["parts"]["queue_s"], rel=0.01, abs=1e-6
        )
        assert r["summary"].startswith(f"{r['request_id']} took ")
    return results


def test_requests_held_back_by_max_num_seqs_are_explained_by_it(tmp_path) -> None:
    db = str(tmp_path / "seqs.duckdb")
    prompts = [f"Request {i}: " + "alpha beta " * 5 for i in range(4)]
    offline_trace(db, prompts, [12] * 4, max_num_seqs=1, num_kv_blocks=64)
    store = TraceStore(db, read_only=True)
    try:
        results = assert_parts_add_up(store)
        # The last admitted waited for the three before it; it is also the slowest, unless a
        # hiccup (a loaded machine) stretched another request's steps.
        last = max(results, key=lambda r: r["parts"]["queue_s"])
        assert largest_part(last)[0] == "queue_s"
        assert max(last["queue_reasons"], key=last["queue_reasons"].get) == "max_num_seqs"
        assert "max_num_seqs" in last["summary"]
        assert last["shared"]["other_requests_max"] == 0  # one at a time: nothing shared
        # It waited at least as long as the three ahead of it were served, one after another.
        others = [r for r in results if r is not last]
        served = sum(r["parts"]["prefill_s"] + r["parts"]["decode_s"] for r in others)
        assert last["parts"]["queue_s"] >= served - 1e-5
        assert explain(store)["request_id"] == results[0]["request_id"]  # no id: the slowest
    finally:
        store.close()


def test_a_pool_that_forces_preemptions_is_explained_by_them(tmp_path) -> None:
    """Seven blocks of 16 tokens, no prefix cache. Requests 0 and 1 (21-token prompts, 60 tokens
    out) and 2 (45 tokens, 8 out) fill the pool at once; 2 needs a fourth block first and is
    preempted after a few tokens, then waits until the others have finished, and recomputes."""
    db = str(tmp_path / "preempt.duckdb")
    prompts = [f"Request {i}: " + "alpha beta " * reps for i, reps in enumerate((8, 8, 20))]
    offline_trace(db, prompts, [60, 60, 8], num_kv_blocks=7, block_size=16,
                  enable_prefix_caching=False)  # fmt: skip
    store = TraceStore(db, read_only=True)
    try:
        results = {r["request_id"]: r for r in assert_parts_add_up(store)}
        victim = results["2"]
        assert victim["preemptions"] >= 1 and victim["recomputed_tokens"] > 0
        assert largest_part(victim)[0] == "preempted_s", victim["parts"]
        assert "preempted" in victim["summary"]
        assert results["0"]["preemptions"] == 0 and results["0"]["parts"]["preempted_s"] == 0
    finally:
        store.close()


async def _long_then_short(server: Server) -> tuple[str, str]:
    """A long prompt, and a short one sent while the long one is being prefilled."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

        async def complete(prompt: str, max_tokens: int) -> str:
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["id"] + "-0"

        long = asyncio.create_task(complete("alpha beta gamma " * 500, 4))
        deadline = time.monotonic() + 60
        while server.metric("stepscope:num_requests_running") < 1:
            assert time.monotonic() < deadline and not long.done()
            await asyncio.sleep(0.005)
        short = await complete("A short question?", 4)
        return await long, short


@pytest.mark.slow
def test_a_short_request_behind_a_long_chunked_prefill_waits_for_it(tmp_path) -> None:
    db = str(tmp_path / "serve.duckdb")
    server = Server("--model", "tiny-llama", "--trace-db", db, "--num-kv-blocks", "160",
                    "--max-num-batched-tokens", "32", timeout=300)  # fmt: skip
    try:
        long_id, short_id = asyncio.run(_long_then_short(server))
    finally:
        server.stop()
    store = TraceStore(db, read_only=True)
    try:
        assert_parts_add_up(store)
        short = explain(store, short_id)
        assert largest_part(short)[0] == "queue_s", short["parts"]
        # It reached the engine core while a chunk of the long prompt ran, then the long
        # prompt's chunks took the whole budget until its last one.
        assert short["queue_reasons"]["arrived_during_step"] > 0
        assert set(short["queue_reasons"]) <= {"arrived_during_step", "budget"}
        assert short["shared"]["other_requests_max"] == 1
        long = explain(store, long_id)
        assert long["shared"]["prefill_steps"] > 10
    finally:
        store.close()
    # The CLI prints the same answer, as JSON with exactly the documented keys, or as a table.
    out = subprocess.run([*CLI, "trace", "explain", db, short_id, "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    assert json.loads(out) == short
    text = subprocess.run([*CLI, "trace", "slowest", db, "-n", "2"], capture_output=True,
                          text=True, timeout=120, check=True).stdout  # fmt: skip
    assert short_id in text or long_id in text
    missing = subprocess.run([*CLI, "trace", "explain", db, "nope"], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert missing.returncode == 1 and "no request 'nope'" in missing.stderr


def test_overlapping_steps_of_async_scheduling_count_once(tmp_path) -> None:
    """With async scheduling each step span starts while the step before it runs. The parts
    still add up, and the time a request's steps gave to the other requests' tokens is a share of
    each step's own time: less than the time the request spent in its steps, where summing the
    overlapping spans would count much of it twice."""
    db = str(tmp_path / "async.duckdb")
    prompts = [f"Request {i}: " + "alpha beta " * 5 for i in range(4)]
    offline_trace(db, prompts, [12] * 4, num_kv_blocks=64, async_scheduling=True)
    store = TraceStore(db, read_only=True)
    try:
        steps = store.df("SELECT start_ns, end_ns FROM steps ORDER BY start_ns")
        assert (steps["start_ns"].values[1:] < steps["end_ns"].values[:-1]).all()
        for r in assert_parts_add_up(store):
            in_steps = r["parts"]["prefill_s"] + r["parts"]["decode_s"]
            assert 0 < r["shared"]["interference_s"] < in_steps, r
            # The first decode is scheduled before the first token is back: still a decode.
            assert (r["shared"]["prefill_steps"], r["shared"]["decode_steps"]) == (1, 11)
    finally:
        store.close()
