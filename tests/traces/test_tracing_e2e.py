"""Spans of a real `stepscope serve --tp 2 --trace-db ...` run, read back from DuckDB."""

from __future__ import annotations

import asyncio

import openai
import pytest

from stepscope.traces.backend import queries
from stepscope.traces.backend.store import TraceStore
from tests.server_utils import Server

pytestmark = pytest.mark.slow  # a traced TP=2 server

MODEL = "tiny-llama"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> TraceStore:
    db = tmp_path_factory.mktemp("trace") / "run.duckdb"
    server = Server(
        "--model",
        MODEL,
        "--tp",
        "2",
        "--num-kv-blocks",
        "128",
        "--max-num-batched-tokens",
        "32",
        "--trace-db",
        str(db),
    )
    try:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def run() -> None:
            calls = [
                client.completions.create(
                    model=MODEL,
                    prompt=f"Request {i}: " + "word " * (4 + 7 * i),
                    max_tokens=4 + i % 5,
                    temperature=0,
                )
                for i in range(20)
            ]
            await asyncio.gather(*calls)
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "traced"}],
                max_tokens=3,
                extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
            )

        asyncio.run(run())
    finally:
        server.stop()  # flushes every process, then the collector closes the file
    store = TraceStore(db, read_only=True)
    yield store
    store.close()


def test_every_request_has_its_root_span(trace) -> None:
    requests = trace.df("select * from requests")
    assert len(requests) == 21
    assert requests["trace_id"].notna().all() and (requests["output_tokens"] > 0).all()
    roots = trace.df("select * from spans where name = 'stepscope.request'")
    assert len(roots) == 21


def test_each_boundary_has_matching_sends_and_receives(trace) -> None:
    counts = trace.df(
        "select boundary, side, count(*) as n from crossings group by 1, 2"
    ).set_index(["boundary", "side"])["n"]
    assert counts["api->engine_core", "send"] == counts["api->engine_core", "receive"] == 21
    # One SchedulerOutput broadcast reaches both workers: one send, two receives.
    assert counts["engine_core->worker", "receive"] == 2 * counts["engine_core->worker", "send"]
    assert counts["worker->engine_core", "send"] == counts["worker->engine_core", "receive"]
    assert counts["engine_core->worker", "send"] == counts["worker->engine_core", "send"]
    assert counts["engine_core->api", "send"] == counts["engine_core->api", "receive"]
    joined = trace.df(
        "select count(*) as n from crossings r join crossings s "
        "on r.parent_span_id = s.span_id where r.side = 'receive' and s.side = 'send'"
    )["n"][0]
    assert joined == int(counts.xs("receive", level="side").sum())


def test_every_step_has_its_span_and_its_token_split(trace) -> None:
    steps = trace.df("select * from steps order by step")
    assert list(steps["step"]) == list(range(len(steps)))
    served = trace.df(
        "select step, sum(num_tokens) as tokens, count(*) as n from step_requests group by step"
    ).set_index("step")
    busy = steps[steps["num_decode_tokens"] + steps["num_prefill_tokens"] > 0]
    for row in busy.itertuples():
        assert row.num_decode_tokens + row.num_prefill_tokens == served.loc[row.step, "tokens"]
        assert row.num_decode_tokens + row.num_prefill_tokens <= row.token_budget == 32


def test_both_ranks_record_a_worker_span_per_step(trace) -> None:
    ranks = trace.df("select rank, count(*) as n from worker_steps group by rank order by rank")
    assert list(ranks["rank"]) == [0, 1]
    assert ranks["n"][0] == ranks["n"][1] > 0


def test_step_requests_covers_every_request(trace) -> None:
    missing = trace.df(
        "select request_id from requests except select request_id from step_requests"
    )
    assert missing.empty


def test_incoming_traceparent_is_the_parent_of_the_request_span(trace) -> None:
    row = trace.df(
        "select trace_id, parent_span_id from spans where name = 'stepscope.request' "
        f"and trace_id = '{TRACE_ID}'"
    )
    assert len(row) == 1 and row["parent_span_id"][0] == PARENT_SPAN_ID
    # Its crossing into the engine core lives in the same trace.
    crossings = trace.df(f"select * from crossings where trace_id = '{TRACE_ID}'")
    assert {"send", "receive"} <= set(crossings["side"])


def test_queries_answer_queue_time_ttft_and_steps(trace) -> None:
    rid = trace.df("select request_id from requests order by input_tokens desc limit 1")[
        "request_id"
    ][0]
    t = queries.request_timings(trace, rid)
    assert 0 <= t["queue_time_s"] <= t["ttft_s"] <= t["e2e_s"]
    # A long prompt under a 32-token budget is prefilled in several chunks.
    assert t["num_prefill_steps"] >= 2 and t["num_decode_steps"] >= 1
    step = t["first_step"]
    split = trace.df(f"select * from step_requests where step = {step}")
    assert rid in set(split["request_id"])
    path = queries.request_path(trace, rid)
    assert path is not None
