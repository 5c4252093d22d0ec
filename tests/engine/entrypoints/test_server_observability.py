"""What a live server says about each request and its queue (issue 40, item 5), over HTTP:
vLLM's opt-in per-request `metrics` object, the `stepscope:num_requests_waiting_by_reason`
gauge, and the long-wait warning with its span event. The pure parts first, then the shared
server (tests/engine/conftest.py, started without the flag) and one server of this module's own,
with `--enable-per-request-metrics`, one running sequence and a 20 ms long-wait threshold."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from stepscope.engine.entrypoints.openai_responses import timing_metrics
from stepscope.engine.metrics import ServerMetrics
from stepscope.engine.outputs import RequestMetrics
from stepscope.traces import names
from stepscope.traces.backend.source import CollectorSource
from tests.process_tree import ProcessTree
from tests.server_utils import API_KEY, SERVED_MODEL, Server

# Every reason the scheduler records, grammar compiles included (one series each).
REASONS = ("budget", "max_num_seqs", "kv_blocks", "preempted", "grammar")
FIELDS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
          "tokens_per_second"}  # fmt: skip
GAUGE = "stepscope:num_requests_waiting_by_reason"


# ---- pure parts ---------------------------------------------------------------------------------
def test_timing_metrics_follow_vllms_definitions() -> None:
    m = RequestMetrics(arrival_time=0.5, queued_time=1.0, first_scheduled_time=1.5,
                       first_token_time=2.0, finished_time=3.0)  # fmt: skip
    got = timing_metrics(m, 10)
    assert got == pytest.approx(
        {
            "time_to_first_token_ms": 500.0,  # from scheduling, as vLLM's, not from arrival
            "generation_time_ms": 1000.0,
            "queue_time_ms": 500.0,
            "mean_itl_ms": 1000.0 / 9,
            "tokens_per_second": 10 / 1.5,
        }
    )
    assert timing_metrics(m, 1)["mean_itl_ms"] is None  # one token: no gap between tokens
    assert set(timing_metrics(None, 3).values()) == {None}
    unfinished = RequestMetrics(arrival_time=0.5, queued_time=1.0, first_scheduled_time=1.5)
    assert timing_metrics(unfinished, 0)["queue_time_ms"] == pytest.approx(500.0)
    assert timing_metrics(unfinished, 0)["tokens_per_second"] is None


def _stats(reason: str | None, held: int) -> dict:
    by_reason = {r: held if r == reason else 0 for r in REASONS}
    return {"num_running": 1, "num_waiting": held, "num_waiting_by_reason": by_reason,
            "kv_cache_usage": 0.5, "prefix_queries": 0, "prefix_hits": 0, "num_preemptions": 0,
            "step_tokens_counts": [0] * 14, "step_tokens_sum": 0, "num_busy_steps": 0}  # fmt: skip


def test_waiting_by_reason_gauge_has_a_series_per_reason_and_per_dp_rank() -> None:
    text = ServerMetrics("m").render(_stats("kv_blocks", 3), 0)
    assert f"# TYPE {GAUGE} gauge" in text
    assert f'{GAUGE}{{model_name="m",reason="kv_blocks"}} 3' in text
    assert f'{GAUGE}{{model_name="m",reason="budget"}} 0' in text
    ranks = [_stats("max_num_seqs", 2), _stats(None, 0)]
    text = ServerMetrics("m", api_server=1).render({**_stats(None, 0), "ranks": ranks}, 0)
    assert f'{GAUGE}{{model_name="m",api_server="1",engine="0",reason="max_num_seqs"}} 2' in text
    assert f'{GAUGE}{{model_name="m",api_server="1",engine="1",reason="max_num_seqs"}} 0' in text
    assert len(re.findall(f"^{GAUGE}{{", text, re.M)) == 2 * len(REASONS)


# ---- the shared server: no flag, no metrics -----------------------------------------------------
def test_metrics_object_absent_unless_the_server_is_asked(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    full = client.completions.create(model=SERVED_MODEL, prompt="Hi", max_tokens=2)
    assert "metrics" not in full.model_dump()
    chunks = list(
        client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    assert chunks[-1].usage is not None and "metrics" not in chunks[-1].model_dump()
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert {m for m in re.findall(f'^{GAUGE}{{.*reason="(\\w+)"}}', text, re.M)} == set(REASONS)


# ---- this module's server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def busy(tmp_path_factory) -> Iterator[tuple[Server, Path]]:
    """A server that answers with `metrics`, runs one sequence at a time (so requests wait,
    held back by max_num_seqs) and warns past 20 ms; its stdout and stderr go to a file."""
    log = tmp_path_factory.mktemp("busy") / "server.log"
    db = log.with_name("trace.duckdb")
    tree = ProcessTree()
    try:
        with tree.adopting(), log.open("w") as out:
            saved = os.dup(1), os.dup(2)
            os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)  # what the server inherits
            try:
                s = Server(
                    "--model", SERVED_MODEL, "--num-kv-blocks", "64", "--max-model-len", "256",
                    "--max-num-seqs", "1", "--enable-per-request-metrics",
                    "--long-wait-warning-s", "0.02", "--trace-db", str(db),
                )  # fmt: skip
            finally:
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                os.close(saved[0]), os.close(saved[1])
        try:
            yield s, log
        finally:
            s.stop()
    finally:
        tree.kill()


def _check(metrics: dict, num_tokens: int, wall_s: float) -> None:
    assert set(metrics) == FIELDS and all(v is not None and v >= 0 for v in metrics.values())
    ttft, gen, queue = (metrics[k] for k in ("time_to_first_token_ms", "generation_time_ms",
                                             "queue_time_ms"))  # fmt: skip
    assert queue + ttft + gen <= wall_s * 1000  # all inside the client's own wait
    assert metrics["mean_itl_ms"] == pytest.approx(gen / (num_tokens - 1))
    assert metrics["tokens_per_second"] == pytest.approx(num_tokens / (ttft + gen) * 1000)


@pytest.mark.slow  # its own server
def test_metrics_object_on_completions_and_chat_streamed_and_not(busy) -> None:
    server, _ = busy
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    common = {"model": SERVED_MODEL, "max_tokens": 4, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for create, kwargs in ((client.completions.create, {"prompt": "Once"}),
                           (client.chat.completions.create, chat)):  # fmt: skip
        t0 = time.monotonic()
        full = create(**kwargs, **common).model_dump()
        _check(full["metrics"], 4, time.monotonic() - t0)
        t0 = time.monotonic()
        chunks = [
            c.model_dump()
            for c in create(**kwargs, **common, stream=True, stream_options={"include_usage": True})
        ]
        _check(chunks[-1]["metrics"], 4, time.monotonic() - t0)  # on the usage chunk only
        assert all("metrics" not in c for c in chunks[:-1])
    # Not one generation stream: null, as vLLM's.
    two = client.completions.create(prompt="Once", n=2, **common).model_dump()
    assert "metrics" in two and two["metrics"] is None


@pytest.mark.slow  # its own server
def test_waiting_requests_are_gauged_warned_about_and_marked_on_their_spans(busy) -> None:
    server, log = busy

    async def burst() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def one(i: int) -> str:
            r = await client.completions.create(
                model=SERVED_MODEL, prompt=f"Story {i}:", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.id

        async def scrape() -> str:  # while the burst runs: requests wait behind the one running
            while True:
                text = (await asyncio.to_thread(httpx.get, f"{server.url}/metrics")).text
                if _value(text, GAUGE, "max_num_seqs") >= 1:
                    return text
                await asyncio.sleep(0.01)

        done = asyncio.gather(*(one(i) for i in range(3)))
        text = await asyncio.wait_for(scrape(), timeout=60)
        assert _value(text, GAUGE, "max_num_seqs") <= _value(text, "stepscope:num_requests_waiting")
        assert all(_value(text, GAUGE, r) == 0 for r in ("budget", "kv_blocks", "preempted"))
        return await done

    ids = {f"{i}-0" for i in asyncio.run(burst())}  # the engine core's request ids
    # Requests 2 and 3 waited for the whole of request 1: each is named once, with the reason.
    found = re.findall(r"request (\S+) has waited .*", log.read_text())
    lines = [line for line in log.read_text().splitlines() if "has waited" in line]
    warned = [rid for rid in found if rid in ids]
    assert len(warned) == len(set(warned)) >= 2
    assert all("max_num_seqs" in line for line in lines if line.split()[2] in ids)
    # ...and their request spans carry the event (read live from the server's collector).
    url = re.search(r"\(collector (\S+)\)", log.read_text())[1]
    source = CollectorSource(url)
    sql = f"SELECT attributes, events FROM spans WHERE name = '{names.REQUEST}'"
    deadline = time.monotonic() + 30
    while True:
        marked = {}  # request id -> its long_wait events
        for row in source.df(sql).itertuples():
            rid = json.loads(row.attributes)[names.REQUEST_ID]
            if rid in ids:
                marked[rid] = [e for e in json.loads(row.events) if e["name"] == "long_wait"]
        if len(marked) == len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # the API process exports its spans every 2 s
    assert {rid for rid, events in marked.items() if events} == set(warned)
    for events in marked.values():
        assert len(events) <= 1
        for e in events:
            assert e["attributes"][names.WAITING_REASON] == "max_num_seqs"
            assert e["attributes"][names.WAITED_S] >= 0.02


def _value(text: str, name: str, reason: str | None = None) -> float:
    label = "" if reason is None else f',reason="{reason}"'
    found = re.search(f"^{re.escape(name)}{{[^}}]*?{re.escape(label)}}} (\\S+)$", text, re.M)
    assert found, (name, reason)
    return float(found[1])
