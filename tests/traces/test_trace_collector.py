"""The collector process: real OTLP/HTTP from SDK providers in several processes into one file."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from stepscope.traces import crossing_spans as cs
from stepscope.traces import names as n
from stepscope.traces import setup
from stepscope.traces import spans as sp
from stepscope.traces.backend import cli
from stepscope.traces.backend.client import CollectorClient
from stepscope.traces.backend.collector import Collector, HttpResponse
from stepscope.traces.backend.collector_process import stop_collector_process as stop
from stepscope.traces.backend.store import TraceStore

# A worker process: receives the SchedulerOutput's carrier, runs a step, sends its output back.
WORKER = """
import json, sys
from stepscope.traces import crossing_spans as cs, names as n, setup, spans as sp
url, carrier = sys.argv[1], json.loads(sys.argv[2])
setup.init_tracing(n.SERVICE_WORKER, rank=1, collector_endpoint=url)
with cs.receive_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 100, 2, carrier):
    pass
with sp.worker_step_span(0, 1, carrier):
    with sp.child_span(n.FORWARD):
        pass
    crossing, back = cs.send_span(n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", 40, 2)
    with crossing:
        pass
assert setup.shutdown_tracing() == 0
print(json.dumps(back))
"""


def test_every_emitted_span_reaches_the_file_and_group_signals_do_not_stop_it(collector):
    process, url, db_path = collector
    # What a terminal or a process manager sends the whole group is its parent's to handle.
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        process.popen.send_signal(signum)
    setup.init_tracing(n.SERVICE_ENGINE_CORE, collector_endpoint=url)
    for step in range(2500):
        with sp.step_span(step=step), sp.child_span(n.SCHEDULE):
            pass
    assert setup.shutdown_tracing() == 0  # all 5,000 accepted by the collector
    # No flush from us: told to close, the collector inserts what it accepted, then closes,
    # and says what it holds and what its one sender reported lost.
    summary = stop(process)
    assert process.exitcode == 0
    assert (summary["spans"], summary["processes"], summary["lost"]) == (5000, 1, 0)
    assert summary["silent"] == []
    store = TraceStore(db_path, read_only=True)
    assert store.count() == 5000
    assert store.count(n.ENGINE_STEP) == store.count(n.SCHEDULE) == 2500
    assert store.query("SELECT count(DISTINCT step) AS c FROM steps")[0]["c"] == 2500


def test_send_and_receive_join_across_real_processes(collector):
    process, url, db_path = collector
    setup.init_tracing(n.SERVICE_ENGINE_CORE, collector_endpoint=url)
    with sp.step_span(step=0), sp.child_span(n.EXECUTE):
        crossing, carrier = cs.send_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 100, 2)
        with crossing:
            worker = subprocess.run(
                [sys.executable, "-c", WORKER, url, json.dumps(carrier)],
                capture_output=True,
                text=True,
                check=True,
            )
        back = json.loads(worker.stdout)
        with cs.receive_span(n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", 40, 2, back):
            pass
    assert setup.shutdown_tracing() == 0

    client = CollectorClient(url)
    assert client.flush()["flushed"]
    rows = client.query(
        "SELECT name, service_name, rank, trace_id, span_id, parent_span_id FROM spans"
    )
    by = {(r["name"], r["service_name"]): r for r in rows}
    engine_send = by[(n.SEND, n.SERVICE_ENGINE_CORE)]
    worker_receive = by[(n.RECEIVE, n.SERVICE_WORKER)]
    worker_send = by[(n.SEND, n.SERVICE_WORKER)]
    engine_receive = by[(n.RECEIVE, n.SERVICE_ENGINE_CORE)]
    worker_step = by[(n.WORKER_STEP, n.SERVICE_WORKER)]
    assert worker_receive["parent_span_id"] == engine_send["span_id"]
    assert worker_step["parent_span_id"] == engine_send["span_id"]
    assert worker_send["parent_span_id"] == worker_step["span_id"]
    assert engine_receive["parent_span_id"] == worker_send["span_id"]
    assert worker_step["rank"] == 1 and worker_receive["rank"] == 1
    assert len({r["trace_id"] for r in rows}) == 1  # one step, one trace, two processes
    pairs = client.df(
        "SELECT s.boundary FROM crossings s JOIN crossings r ON r.parent_span_id = s.span_id "
        "WHERE s.side = 'send' AND r.side = 'receive' ORDER BY s.start_ns"
    )
    assert list(pairs["boundary"]) == [n.ENGINE_CORE_TO_WORKER, n.WORKER_TO_ENGINE_CORE]
    out = io.StringIO()
    cli.trace_summary(url, out=out)  # the CLI reads a running collector too
    assert n.WORKER_TO_ENGINE_CORE in out.getvalue() and n.SERVICE_WORKER in out.getvalue()


def _post(url: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_query_endpoint_serves_selects_only(collector):
    _, url, _ = collector
    client = CollectorClient(url)
    assert client.query("SELECT 1 + 1 AS two") == [{"two": 2}]
    assert client.query("SELECT count(*) AS c FROM spans WHERE name = ?", ["x"]) == [{"c": 0}]
    for statement in ("DELETE FROM spans", "SELECT 1; DROP TABLE spans", "COPY spans TO 'x.csv'"):
        status, body = _post(url + "/query", statement.encode(), "text/plain")
        assert status == 403, statement
        assert "only a single SELECT" in json.loads(body)["error"]
    status, body = _post(url + "/query", b"SELECT * FROM read_csv('/etc/passwd')", "text/plain")
    assert status == 400  # no file access from SQL sent over the network
    with urllib.request.urlopen(url + "/query?sql=SELECT%2042%20AS%20x", timeout=30) as response:
        assert json.loads(response.read()) == {"columns": ["x"], "rows": [[42]]}


def test_collector_rejects_what_is_not_otlp_protobuf(collector):
    _, url, _ = collector
    assert _post(url + "/v1/traces", b"{}", "application/json")[0] == 415
    assert _post(url + "/v1/traces", b"\xff\xff\xff", "application/x-protobuf")[0] == 400
    stats = CollectorClient(url).stats()
    assert stats["bad_requests"] == 1 and stats["received"] == 0


def test_collector_routes_can_be_extended_in_process(tmp_path):
    collector = Collector(str(tmp_path / "ext.duckdb"))
    collector.add_route(
        "GET", "/dashboard/", lambda req: HttpResponse(200, req.path.encode(), "text/plain"),
        prefix=True,
    )  # fmt: skip
    collector.start()
    try:
        with urllib.request.urlopen(collector.url + "/dashboard/app.js", timeout=30) as response:
            assert response.read() == b"/dashboard/app.js"
        assert collector.query("SELECT count(*) FROM steps") == (["count_star()"], [(0,)])
    finally:
        collector.close()
    assert TraceStore(tmp_path / "ext.duckdb", read_only=True).count() == 0


def test_second_collector_on_the_same_file_fails_loudly(collector):
    from stepscope.traces.backend.collector_process import start_collector_process

    _, _, db_path = collector
    with pytest.raises(RuntimeError, match="collector failed to start"):
        start_collector_process(db_path)


def test_the_closing_counts_name_lost_spans_and_senders_that_never_reported(collector):
    process, url, _ = collector
    # A sender killed before it could report: its spans arrived, its counts never did.
    killed = (
        "import os, sys\n"
        "from stepscope.traces import crossing_spans as cs, names as n, setup, spans as sp\n"
        "setup.init_tracing(n.SERVICE_WORKER, rank=0, collector_endpoint=sys.argv[1])\n"
        "with sp.step_span(step=0):\n    pass\n"
        "setup.flush_tracing()\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", killed, url], check=True, timeout=60)
    # A sender whose queue overflows: most of its 50 spans never leave it, and it says so. How
    # many is up to the export thread (a full queue wakes it), so the check is that every span
    # is either stored or counted lost, on both sides.
    setup.init_tracing(
        n.SERVICE_ENGINE_CORE, collector_endpoint=url, max_queue_size=10, schedule_delay_ms=60_000
    )
    for step in range(50):
        with sp.step_span(step=step):
            pass
    dropped = setup.shutdown_tracing()
    assert 0 < dropped <= 40
    summary = stop(process)
    assert summary["spans"] == 1 + (50 - dropped) and summary["processes"] == 2
    assert summary["lost"] == dropped
    ((who, lost),) = summary["lost_by"].items()
    assert who.startswith(n.SERVICE_ENGINE_CORE) and lost == dropped
    (silent,) = summary["silent"]
    assert silent.startswith(n.SERVICE_WORKER)
