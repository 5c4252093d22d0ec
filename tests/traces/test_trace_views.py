"""Views, queries and CLI read back what the helpers recorded: two fake steps, three requests."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator

import pytest

from stepscope.engine.core.scheduler import StepStats
from stepscope.traces import crossing_spans as cs
from stepscope.traces import names as n
from stepscope.traces import setup
from stepscope.traces import spans as sp
from stepscope.traces.backend import cli, queries
from stepscope.traces.backend.store import DuckDBSpanExporter, TraceStore

REQUESTS = ("r0", "r1", "r2")
PROMPT = {"r0": 5, "r1": 7, "r2": 3}
T0 = time.time()  # event times, in time.time() seconds as the engine reports them
EVENTS = {
    rid: {
        "queued": T0 + i * 0.001,
        "scheduled": T0 + 0.010,
        "first_token": T0 + 0.020,
        "finished": T0 + 0.030,
    }
    for i, rid in enumerate(REQUESTS)
}


def _step(step: int, stats: StepStats, scheduled: dict[str, int], links: dict) -> None:
    """One engine step as the engine core and a worker record it, boundaries included."""
    with sp.step_span(step=step) as span:
        with sp.child_span(n.SCHEDULE):
            pass
        span.record(stats, scheduled, links=links, kv_total_blocks=64)
        with sp.child_span(n.EXECUTE):
            crossing, carrier = cs.send_span(
                n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", num_requests=len(scheduled)
            )
            with crossing:
                crossing.set_nbytes(900 + step)
            with cs.receive_span(
                n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 900 + step, len(scheduled), carrier
            ):
                pass
            with sp.worker_step_span(step, 0, carrier):
                for phase in (n.PREPARE_INPUTS, n.FORWARD, n.SAMPLE):
                    with sp.child_span(phase):
                        time.sleep(0.0005)
                back, back_carrier = cs.send_span(
                    n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", 120, len(scheduled)
                )
                with back:
                    pass
            with cs.receive_span(
                n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", 120, len(scheduled), back_carrier
            ):
                pass
        with sp.child_span(n.UPDATE):
            pass


@pytest.fixture(scope="module")
def run_file(tmp_path_factory) -> str:
    """Spans of a tiny run, written straight into a DuckDB file, then closed (once per module:
    every test only reads it)."""
    path = str(tmp_path_factory.mktemp("views") / "run.duckdb")
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[DuckDBSpanExporter(path)])
    request_spans = {}
    links = {}
    for rid in REQUESTS:
        request = sp.request_span(
            rid, model="tiny-llama", max_tokens=2, temperature=0.7, top_p=0.9,
            input_tokens=PROMPT[rid],
        )  # fmt: skip
        request_spans[rid] = request
        with request.current():
            crossing, carrier = cs.send_span(n.API_TO_ENGINE_CORE, "EngineCoreRequest", 64, 1)
            with crossing:
                pass
        with cs.receive_span(n.API_TO_ENGINE_CORE, "EngineCoreRequest", 64, 1, carrier):
            pass
        links[rid] = sp.request_link(carrier)

    _step(0, StepStats(0, 3, 0, 0, 15, 32, 60, 58, 4), dict(PROMPT), links)
    second = StepStats(
        1, 2, 1, 2, 0, 32, 58, 57, 0, ("r2",), ("r0",), kv_blocks_by_group=(5, 2),
        kv_group_windows=(0, 512),
    )  # fmt: skip
    _step(1, second, {"r0": 1, "r1": 1}, links)

    crossing, carrier = cs.send_span(
        n.ENGINE_CORE_TO_API, "EngineCoreOutputs", 80, 3, step=1, request_ids=REQUESTS
    )
    with crossing:
        pass
    with cs.receive_span(n.ENGINE_CORE_TO_API, "EngineCoreOutputs", 80, 3, carrier):
        pass
    for rid, request in request_spans.items():
        request.add_events(EVENTS[rid])
        request.finish(output_tokens=2, finish_reasons=["length"], num_cached_tokens=0)
        request.end()
    assert setup.shutdown_tracing() == 0
    return path


@pytest.fixture(scope="module")
def store(run_file) -> Iterator[TraceStore]:
    """The fake run's file, read-only (this module's own: the real runs' are tp2_store and
    dp2_store in tests/traces/conftest.py)."""
    store = TraceStore(run_file, read_only=True)
    yield store
    store.close()


def test_requests_view_has_timeline_and_usage(store):
    rows = {r["request_id"]: r for r in store.query("SELECT * FROM requests")}
    assert set(rows) == set(REQUESTS)
    r1 = rows["r1"]
    assert r1["model"] == "tiny-llama" and r1["operation"] == "chat"
    assert (r1["input_tokens"], r1["output_tokens"], r1["cached_tokens"]) == (7, 2, 0)
    assert r1["finish_reason"] == "length"
    assert r1["queued_ns"] == int(EVENTS["r1"]["queued"] * 1e9)
    assert r1["first_token_ns"] == int(EVENTS["r1"]["first_token"] * 1e9)
    assert r1["queue_time_s"] == pytest.approx(0.009, abs=1e-6)
    assert r1["e2e_s"] == pytest.approx((r1["end_ns"] - r1["start_ns"]) / 1e9)
    attributes = json.loads(
        store.query("SELECT attributes FROM spans WHERE span_id = ?", [r1["span_id"]])[0][
            "attributes"
        ]
    )
    assert attributes[n.GEN_AI_REQUEST_TEMPERATURE] == 0.7
    assert attributes[n.GEN_AI_REQUEST_TOP_P] == 0.9
    assert attributes[n.GEN_AI_REQUEST_MAX_TOKENS] == 2


def test_steps_view_has_scheduler_decisions(store):
    steps = store.query("SELECT * FROM steps ORDER BY step")
    assert [s["step"] for s in steps] == [0, 1]
    first, second = steps
    assert (first["num_running"], first["num_prefill_tokens"], first["num_decode_tokens"]) == (
        3,
        15,
        0,
    )
    assert (first["token_budget"], first["kv_free_before"], first["kv_free_after"]) == (32, 60, 58)
    assert (first["kv_total_blocks"], first["prefix_hit_tokens"]) == (64, 4)
    assert (second["num_preempted"], second["num_finished"]) == (1, 1)
    assert (first["num_preempted"], first["num_finished"]) == (0, 0)


def test_steps_view_has_blocks_held_per_kv_cache_group(store):
    rows = store.query("SELECT step, kv_blocks_by_group, kv_group_windows FROM steps ORDER BY step")
    # Step 0's stats carried no groups (the attribute is left off); step 1's two groups: a
    # full-attention one and one with a window of 512 tokens.
    assert [r["kv_blocks_by_group"] for r in rows] == [None, [5, 2]]
    assert [r["kv_group_windows"] for r in rows] == [None, [0, 512]]


def test_step_requests_unnests_served_requests(store):
    rows = store.query("SELECT step, request_id, num_tokens FROM step_requests ORDER BY step, 2")
    assert [(r["step"], r["request_id"], r["num_tokens"]) for r in rows] == [
        (0, "r0", 5),
        (0, "r1", 7),
        (0, "r2", 3),
        (1, "r0", 1),
        (1, "r1", 1),
    ]


def test_steps_link_to_request_spans(store):
    request_spans = {r["span_id"]: r["request_id"] for r in store.query("SELECT * FROM requests")}
    links = json.loads(
        store.query(f"SELECT links FROM spans WHERE name = '{n.ENGINE_STEP}' AND "
                    f"""json_extract(attributes, '$."{n.STEP}"') = 0""")[0]["links"]
    )  # fmt: skip
    assert {request_spans[link["span_id"]] for link in links} == set(REQUESTS)
    assert all(link["attributes"][n.REQUEST_ID] == request_spans[link["span_id"]] for link in links)


def test_every_receive_is_a_child_of_its_send(store):
    pairs = store.query(
        "SELECT s.boundary, s.message_type, r.side AS receive_side, s.bytes "
        "FROM crossings s JOIN crossings r ON r.parent_span_id = s.span_id "
        "WHERE s.side = 'send' AND r.side = 'receive'"
    )
    sends = store.query("SELECT count(*) AS c FROM crossings WHERE side = 'send'")[0]["c"]
    receives = store.query("SELECT count(*) AS c FROM crossings WHERE side = 'receive'")[0]["c"]
    assert len(pairs) == sends == receives == 3 + 2 * 2 + 1
    assert {p["boundary"] for p in pairs} == set(n.BOUNDARIES)
    sizes = {p["message_type"]: p["bytes"] for p in pairs if p["boundary"] != n.API_TO_ENGINE_CORE}
    assert sizes["ModelRunnerOutput"] == 120 and sizes["EngineCoreOutputs"] == 80
    api_request = store.query(
        "SELECT * FROM crossings WHERE boundary = ? AND side = 'send'", [n.API_TO_ENGINE_CORE]
    )[0]
    assert api_request["message_type"] == "EngineCoreRequest" and api_request["num_requests"] == 1
    assert api_request["service_name"] == n.SERVICE_ENGINE_CORE


def test_worker_steps_view_times_phases(store):
    rows = store.query("SELECT * FROM worker_steps ORDER BY step")
    assert [(r["step"], r["rank"]) for r in rows] == [(0, 0), (1, 0)]
    for row in rows:
        assert row["prepare_s"] > 0 and row["forward_s"] > 0 and row["sample_s"] > 0
        assert row["prepare_s"] + row["forward_s"] + row["sample_s"] <= (
            (row["end_ns"] - row["start_ns"]) / 1e9
        )


def test_request_path_follows_all_four_boundaries(store):
    path = queries.request_path(store, "r0")
    assert path.request["request_id"] == "r0"
    assert list(path.steps["step"]) == [0, 1]
    assert list(path.steps["num_tokens"]) == [5, 1]
    boundaries = set(zip(path.crossings["boundary"], path.crossings["side"], strict=True))
    assert boundaries == {(b, side) for b in n.BOUNDARIES for side in ("send", "receive")}
    assert list(path.crossings["start_ns"]) == sorted(path.crossings["start_ns"])
    # r2 was served by step 0 only: step 1's engine_core<->worker crossings are not its.
    r2 = queries.request_path(store, "r2")
    assert set(r2.crossings["step"].dropna()) == {0}


def test_request_timings_counts_prefill_and_decode_steps(store):
    timings = queries.request_timings(store, "r0")
    assert (timings["num_steps"], timings["num_prefill_steps"], timings["num_decode_steps"]) == (
        2,
        1,
        1,
    )
    assert timings["scheduled_tokens"] == 6
    assert (timings["first_step"], timings["last_step"]) == (0, 1)
    assert timings["queue_time_s"] == pytest.approx(0.010, abs=1e-6)
    with pytest.raises(KeyError):
        queries.request_timings(store, "nope")


def test_summary_counts_spans_and_crossings(store):
    tables = queries.summary(store)
    counts = tables["spans"].groupby("name")["spans"].sum().to_dict()
    assert counts[n.REQUEST] == 3 and counts[n.ENGINE_STEP] == 2 and counts[n.WORKER_STEP] == 2
    assert counts[n.SEND] == counts[n.RECEIVE] == 8
    crossings = tables["crossings"]
    assert len(crossings) == 8  # four boundaries x two sides
    assert int(tables["steps"]["steps"][0]) == 2
    ranks = tables["ranks"]  # one DP rank: one row
    assert list(ranks["dp_rank"]) == [0] and list(ranks["steps"]) == [2]
    assert list(ranks["requests"]) == [3]
    assert list(tables["latency"]["metric"]) == ["queue_time_s", "ttft_s", "e2e_s", "step_s"]


def test_cli_prints_summary_and_request(run_file, capsys):
    out = io.StringIO()
    cli.trace_summary(run_file, out=out)
    text = out.getvalue()
    assert n.ENGINE_STEP in text and n.ENGINE_CORE_TO_WORKER in text and "ttft_s" in text
    assert "work per DP rank" not in text and "dp_rank" not in text  # one DP rank

    out = io.StringIO()
    assert cli.trace_request(run_file, "r1", out=out) == 0
    text = out.getvalue()
    assert "request r1" in text and "EngineCoreOutputs" in text and "steps that served it" in text
    assert cli.trace_request(run_file, "missing", out=io.StringIO()) == 1
    assert "no request 'missing'" in capsys.readouterr().err
