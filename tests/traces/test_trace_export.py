"""`stepscope trace export`: a trace as Chrome trace-event JSON that Perfetto UI and
chrome://tracing open, checked event by event against the trace it came from.

Two recorded traces: a real offline run (`LLM`, every role in one process) and the dashboard's
trace factory (the real scheduler, an API, an engine core and two TP workers each recording as
its own process, with chunked prefills and preemptions). A small hand-made trace covers what
neither has: data parallelism, the DP coordinator, two API processes told apart by `process.pid`,
and requests aborted before their later events.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from stepscope.traces import names as n
from stepscope.traces.backend import export, queries
from stepscope.traces.backend.store import TraceStore
from tests.server_utils import CLI
from tests.viz.trace_factory import write_trace


@pytest.fixture(scope="module", params=["offline", "factory"])
def trace_db(request, tmp_path_factory) -> str:
    """The session's offline run (tests/traced_runs.py), or the dashboard's trace factory."""
    if request.param == "offline":
        return request.getfixturevalue("traced_offline_run")
    path = tmp_path_factory.mktemp("factory") / "trace.duckdb"
    write_trace(str(path))
    return str(path)


@pytest.fixture(scope="module")
def exported(trace_db, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("export") / "run.json"
    export.write_chrome(trace_db, out)
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def store(trace_db) -> TraceStore:
    store = TraceStore(trace_db, read_only=True)
    yield store
    store.close()


def _ns(us: float) -> int:
    """A time as Perfetto reads it: us * 1000, truncated."""
    return int(us * 1000)


def _of(trace: dict[str, Any], ph: str, cat: str | None = None) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph and cat in (None, e.get("cat"))]


def _threads(trace: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    threads = defaultdict(list)
    for x in _of(trace, "X"):
        threads[x["pid"], x["tid"]].append(x)
    return threads


def _top_level_async(trace: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """Each request's async events, by id."""
    by_id = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] in "ben" and e.get("cat") == export.REQUEST_CATEGORY:
            by_id[e["id"]].append(e)
    return by_id


# ---- the recorded traces -------------------------------------------------------------------------
def test_the_file_is_chrome_json_object_format(exported):
    assert exported["displayTimeUnit"] == "ms"
    events = exported["traceEvents"]
    assert events and all({"ph", "pid"} <= e.keys() for e in events)
    timed = [e["ts"] for e in events if "ts" in e]
    assert all(isinstance(ts, float) for ts in timed)
    assert min(timed) >= 0 and min(timed) < 0.001  # us from the trace's first span


def test_one_complete_event_per_engine_and_worker_step(exported, store):
    steps = _of(exported, "X", n.ENGINE_STEP)
    assert len(steps) == store.query("SELECT count(*) AS n FROM steps")[0]["n"] > 0
    assert len(_of(exported, "X", n.WORKER_STEP)) == store.count(n.WORKER_STEP)
    rows = store.df("SELECT span_id, step, num_running, num_waiting, duration_s FROM steps")
    by_span = {x["args"]["span_id"]: x for x in steps}
    for row in rows.itertuples():
        x = by_span[row.span_id]
        assert x["name"] == f"step {row.step}"
        assert (x["args"]["num_running"], x["args"]["num_waiting"]) == (
            row.num_running,
            row.num_waiting,
        )
        assert math.isclose(x["dur"], row.duration_s * 1e6, abs_tol=0.01)
    for name in (n.SCHEDULE, n.EXECUTE, n.UPDATE, n.PREPARE_INPUTS, n.FORWARD, n.SAMPLE):
        assert len(_of(exported, "X", name)) == store.count(name)
    crossings = store.count(n.SEND) + store.count(n.RECEIVE)
    assert len(_of(exported, "X", n.SEND)) + len(_of(exported, "X", n.RECEIVE)) == crossings


def test_slices_nest_properly_on_every_thread(exported):
    # Chrome's rule for slices on one thread, in Perfetto's integer ns: a slice that starts
    # inside another ends inside it too.
    for thread in _threads(exported).values():
        open_ends: list[int] = []
        for x in sorted(thread, key=lambda x: (_ns(x["ts"]), -_ns(x["dur"]))):
            start, end = _ns(x["ts"]), _ns(x["ts"]) + _ns(x["dur"])
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], x
            open_ends.append(end)


def test_a_steps_children_share_its_thread(exported):
    threads = {x["args"]["span_id"]: (x["pid"], x["tid"]) for x in _of(exported, "X", n.SCHEDULE)}
    steps = {(x["pid"], x["tid"]) for x in _of(exported, "X", n.ENGINE_STEP)}
    assert set(threads.values()) <= steps


def test_one_async_slice_per_request_with_its_phases_in_order(exported, store):
    requests = store.df("SELECT * FROM requests")
    by_id = _top_level_async(exported)
    assert len(by_id) == len(requests)
    names = {events[0]["name"] for events in by_id.values()}
    assert names == {f"request {rid}" for rid in requests["request_id"]}
    for events in by_id.values():
        stack = []
        for e in events:  # in file order, nested b/e pairs with one id
            if e["ph"] == "b":
                stack.append(e)
            elif e["ph"] == "e":
                begin = stack.pop()
                assert begin["name"] == e["name"] and begin["ts"] <= e["ts"]
        assert not stack
        # Every request here ran to the end; a phase of no length (same clock tick) is left out.
        phases = [e["name"] for e in events if e["ph"] == "b"][1:]
        assert phases in (["queue", "prefill", "decode"], ["prefill", "decode"]), phases
        times = [e["ts"] for e in events if e["ph"] in "be"]
        assert times == sorted(times)


def test_flows_pair_up_and_bind_inside_slices(exported, store):
    starts = {(e["cat"], e["name"], e["id"]): e for e in _of(exported, "s")}
    ends = {(e["cat"], e["name"], e["id"]): e for e in _of(exported, "f")}
    assert len(starts) == len(_of(exported, "s")) and starts.keys() == ends.keys()
    assert all(e["bp"] == "e" for e in ends.values())
    threads = _threads(exported)
    for end in [*starts.values(), *ends.values()]:
        t = _ns(end["ts"])
        inside = [
            x
            for x in threads[end["pid"], end["tid"]]
            if _ns(x["ts"]) <= t <= _ns(x["ts"]) + _ns(x["dur"])
        ]
        assert inside, end
    served = store.query("SELECT count(*) AS n FROM step_requests")[0]["n"]
    assert sum(1 for key in starts if key[0] == export.STEP_FLOW) == served > 0


def _bound(trace: dict[str, Any]) -> dict[tuple[str, str, int, str], dict[str, Any]]:
    """The slice each flow end binds to, by Perfetto's rule for JSON flow events: the topmost
    slice open on its thread when it is read, events read in time order (ties in file order)."""
    events = trace["traceEvents"]
    order = sorted(range(len(events)), key=lambda i: (_ns(events[i].get("ts", 0)), i))
    stacks: dict[tuple[int, int], list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    bound = {}
    for e in (events[i] for i in order):
        stack = stacks[e["pid"], e.get("tid")]
        if e["ph"] == "X":
            while stack and stack[-1][0] <= _ns(e["ts"]):
                stack.pop()
            stack.append((_ns(e["ts"]) + _ns(e["dur"]), e))
        elif e["ph"] in "sf":
            assert stack, e
            bound[e["cat"], e["name"], e["id"], e["ph"]] = stack[-1][1]
    return bound


def test_request_flows_start_at_the_request_and_end_at_its_steps(exported, store):
    flows = [e for e in exported["traceEvents"] if e.get("cat") == export.STEP_FLOW]
    per_request = Counter(e["args"]["request_id"] for e in flows if e["ph"] == "s")
    expected = store.df("SELECT request_id, count(*) AS n FROM step_requests GROUP BY 1")
    assert per_request == dict(zip(expected["request_id"], expected["n"], strict=True))
    served = store.df(
        f"SELECT sr.request_id, s.span_id FROM step_requests sr JOIN steps s ON {queries.STEP_JOIN}"
    )
    pairs = []
    bound = _bound(exported)
    for s in (e for e in flows if e["ph"] == "s"):
        marker = bound[s["cat"], s["name"], s["id"], "s"]
        step = bound[s["cat"], s["name"], s["id"], "f"]
        assert (
            marker["cat"] == n.REQUEST and marker["args"]["request_id"] == s["args"]["request_id"]
        )
        assert step["cat"] == n.ENGINE_STEP
        pairs.append((marker["args"]["request_id"], step["args"]["span_id"]))
    assert sorted(pairs) == sorted(zip(served["request_id"], served["span_id"], strict=True))


def test_crossing_flows_join_a_parent_to_its_child_in_another_process(exported, store):
    bound = _bound(exported)
    crossings = [e for e in _of(exported, "s") if e["cat"] == export.CROSSING_FLOW]
    links = []
    for s in crossings:
        parent = bound[s["cat"], s["name"], s["id"], "s"]
        child = bound[s["cat"], s["name"], s["id"], "f"]
        assert parent["pid"] != child["pid"]
        links.append((parent["args"]["span_id"], child["args"]["span_id"]))
    expected = store.df(
        "SELECT p.span_id AS parent, c.span_id AS child FROM spans c JOIN spans p "
        "ON c.parent_span_id = p.span_id AND c.trace_id = p.trace_id "
        "WHERE p.resource <> c.resource AND p.name <> ? AND c.name <> ?",
        [n.REQUEST, n.REQUEST],
    )
    assert sorted(links) == sorted(zip(expected["parent"], expected["child"], strict=True))


def test_every_process_and_thread_is_named(exported):
    meta = _of(exported, "M")
    named = {e["pid"] for e in meta if e["name"] == "process_name"}
    sorted_ = {e["pid"] for e in meta if e["name"] == "process_sort_index"}
    threads = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in exported["traceEvents"] if e["ph"] != "M"}
    assert {pid for pid, _ in used} <= named == sorted_
    assert used <= threads


def test_engine_core_counters_follow_each_step(exported, store):
    rows = store.df("SELECT * FROM steps ORDER BY start_ns")
    load = sorted(_of(exported, "C"), key=lambda c: c["ts"])
    requests = [c["args"] for c in load if c["name"] == "requests"]
    assert requests == [
        {"running": r.num_running, "waiting": r.num_waiting} for r in rows.itertuples()
    ]
    free = [c["args"]["free"] for c in load if c["name"] == "KV blocks"]
    assert len(free) == 2 * len(rows)  # before and after each step
    assert set(free) <= {*rows["kv_free_before"], *rows["kv_free_after"]}
    used = [c["args"]["used"] for c in load if c["name"] == "token budget"]
    assert len(used) == len(rows) and all(0 < u <= 1 for u in used)
    step_threads = {(x["pid"], x["tid"]) for x in _of(exported, "X", n.ENGINE_STEP)}
    assert {(c["pid"], c["tid"]) for c in load} <= step_threads


def test_processes_are_named_api_first_then_engine_core_then_workers(exported, store):
    names = {e["pid"]: e["args"]["name"] for e in _of(exported, "M") if e["name"] == "process_name"}
    order = sorted(
        (e["args"]["sort_index"], names[e["pid"]])
        for e in _of(exported, "M")
        if e["name"] == "process_sort_index"
    )
    labels = [name.split(" (pid")[0] for _, name in order]
    services = set(store.df("SELECT DISTINCT service_name FROM spans")["service_name"])
    if services == {n.SERVICE_OFFLINE}:
        assert labels == ["offline LLM (API, engine core and worker)"]
    else:
        assert labels == ["API server", "engine core", "worker TP 0", "worker TP 1"]
    assert exported["otherData"]["processes"] == len(labels)


# ---- a hand-made trace: data parallelism, two API processes, aborted requests -------------------
T0 = 1_800_000_000_000_000_000
_span_ids = itertools.count(1)


def _span(name: str, resource: dict[str, Any], start_ms: float, end_ms: float, **extra: Any):
    span_id = f"{next(_span_ids):016x}"
    return {
        "trace_id": span_id * 2,
        "span_id": span_id,
        "name": name,
        "service_name": resource[n.SERVICE_NAME],
        "start_ns": T0 + int(start_ms * 1e6),
        "end_ns": T0 + int(end_ms * 1e6),
        "resource": resource,
        **extra,
    }


def _request(rid: str, api: dict, start: float, end: float, events: dict[str, float], dp: int):
    attributes = {n.REQUEST_ID: rid, n.DP_RANK: dp, n.GEN_AI_USAGE_INPUT_TOKENS: 5}
    times = [{"name": k, "time_ns": T0 + int(v * 1e6), "attributes": {}} for k, v in events.items()]
    return _span(n.REQUEST, api, start, end, attributes=attributes, events=times)


def _step(core: dict, step: int, start: float, rids: list[str]):
    attributes = {
        n.STEP: step, n.NUM_RUNNING: len(rids), n.NUM_WAITING: 0, n.NUM_DECODE_TOKENS: len(rids),
        n.NUM_PREFILL_TOKENS: 0, n.TOKEN_BUDGET: 64, n.KV_FREE_BEFORE: 10, n.KV_FREE_AFTER: 9,
        n.REQUEST_IDS: rids, n.REQUEST_NUM_TOKENS: [1] * len(rids),
    }  # fmt: skip
    return _span(n.ENGINE_STEP, core, start, start + 2, attributes=attributes)


def _resource(service: str, pid: int, **extra: Any) -> dict[str, Any]:
    return {n.SERVICE_NAME: service, n.PROCESS_PID: pid, **extra}


@pytest.fixture(scope="module")
def dp_export(tmp_path_factory) -> dict[str, Any]:
    api_a, api_b = _resource(n.SERVICE_API, 100), _resource(n.SERVICE_API, 101)
    cores = [_resource(n.SERVICE_ENGINE_CORE, 300 + dp, **{n.DP_RANK: dp}) for dp in (0, 1)]
    workers = [_resource(n.SERVICE_WORKER, 400 + dp, **{n.RANK: 0, n.DP_RANK: dp}) for dp in (0, 1)]
    steps = [_step(cores[0], 0, 1, ["a"]), _step(cores[0], 1, 4, ["a"]), _step(cores[1], 0, 1, [])]
    # Each worker step is a child of its engine step, in another process.
    worker_steps = [
        _span(n.WORKER_STEP, workers[dp], 1.5, 2.5, parent_span_id=step["span_id"],
              attributes={n.STEP: 0, n.RANK: 0})
        for dp, step in ((0, steps[0]), (1, steps[2]))
    ]  # fmt: skip
    publish = _span(
        n.DP_PUBLISH,
        _resource(n.SERVICE_DP_COORDINATOR, 200),
        2,
        2.1,
        attributes={n.DP_NUM_WAITING: [0, 1], n.DP_NUM_RUNNING: [1, 0], n.DP_LOST: [0, 0]},
    )
    ran = {"queued": 0.5, "scheduled": 1, "first_token": 3, "finished": 6}
    requests = [
        _request("a", api_a, 0, 8, ran, 0),
        _request("b", api_b, 0.2, 5, {"queued": 0.6, "finished": 4.5}, 1),  # aborted waiting
        _request("c", api_a, 0.3, 0.4, {}, 0),  # failed before the engine core saw it
    ]  # fmt: skip
    path = tmp_path_factory.mktemp("dp") / "dp.duckdb"
    with TraceStore(path) as store:
        store.insert_spans([*requests, *steps, *worker_steps, publish])
    with TraceStore(path, read_only=True) as store:
        return export.export_chrome(store)


def test_processes_are_told_apart_by_service_ranks_and_pid(dp_export):
    meta = _of(dp_export, "M")
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    order = sorted(
        (e["args"]["sort_index"], names[e["pid"]])
        for e in meta
        if e["name"] == "process_sort_index"
    )
    assert [name for _, name in order] == [
        "API server (pid 100)",
        "API server (pid 101)",
        "DP coordinator (pid 200)",
        "engine core DP 0 (pid 300)",
        "engine core DP 1 (pid 301)",
        "worker TP 0 DP 0 (pid 400)",
        "worker TP 0 DP 1 (pid 401)",
    ]
    steps_per_process = Counter(names[x["pid"]] for x in _of(dp_export, "X", n.ENGINE_STEP))
    assert steps_per_process == {"engine core DP 0 (pid 300)": 2, "engine core DP 1 (pid 301)": 1}
    markers = {x["name"]: names[x["pid"]] for x in _of(dp_export, "X", n.REQUEST)}
    assert markers == {
        "request a": "API server (pid 100)",
        "request b": "API server (pid 101)",
        "request c": "API server (pid 100)",
    }


def test_aborted_requests_get_the_phases_they_reached(dp_export):
    by_id = _top_level_async(dp_export)
    phases = {
        events[0]["name"]: [e["name"] for e in events if e["ph"] == "b"][1:]
        for events in by_id.values()
    }
    assert phases == {
        "request a": ["queue", "prefill", "decode"],
        "request b": ["queue"],
        "request c": [],
    }
    for events in by_id.values():
        assert Counter(e["ph"] for e in events)["b"] == Counter(e["ph"] for e in events)["e"]


def test_flows_cross_processes_and_reach_each_served_step(dp_export):
    starts = _of(dp_export, "s")
    assert Counter(e["cat"] for e in starts) == {export.STEP_FLOW: 2, export.CROSSING_FLOW: 2}
    assert len({e["id"] for e in starts}) == len(starts)
    published = [c for c in _of(dp_export, "C") if c["name"].startswith("published load")]
    assert sorted((c["name"], c["args"]["waiting"]) for c in published) == [
        ("published load DP 0", 0),
        ("published load DP 1", 1),
    ]


def test_an_empty_trace_exports_no_events(tmp_path):
    with TraceStore(tmp_path / "empty.duckdb") as store:
        trace = export.export_chrome(store)
    assert trace["traceEvents"] == [] and trace["otherData"]["processes"] == 0


# ---- the command line ----------------------------------------------------------------------------
def test_cli_writes_the_timeline_and_says_what_it_holds(process_tree, tmp_path):
    db = tmp_path / "run.duckdb"
    write_trace(str(db))
    out = tmp_path / "run.json"
    done = process_tree.run([*CLI, "trace", "export", str(db), "-o", str(out)], timeout=120)
    assert done.returncode == 0, done.stderr
    with open(out) as f:
        trace = json.load(f)
    line = done.stdout.strip()
    assert line == (
        f"wrote {len(trace['traceEvents'])} events (4 processes, 12 requests, "
        f"{trace['otherData']['steps']} engine steps) to {out}"
    )


def test_cli_names_a_missing_trace_file_without_a_traceback(process_tree, tmp_path):
    missing = tmp_path / "nope.duckdb"
    out = tmp_path / "run.json"
    done = process_tree.run(
        [*CLI, "trace", "export", str(missing), "--format", "chrome", "-o", str(out)], timeout=120
    )
    assert done.returncode != 0
    assert f"no trace file at {missing}" in done.stderr
    assert "Traceback" not in done.stderr and not Path(out).exists()
