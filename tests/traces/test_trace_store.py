"""The DuckDB store: spans keep every attribute type, whichever way they arrive."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from stepscope.traces import names as n
from stepscope.traces import setup
from stepscope.traces import spans as sp
from stepscope.traces.backend.store import DuckDBSpanExporter, TraceStore
from stepscope.traces.backend.views import COLUMNS

ATTRIBUTES = {
    "a.string": "text",
    "a.int": 7,
    "a.big_int": 2**62,
    "a.float": 0.25,
    "a.bool": True,
    "a.strings": ["x", "y"],
    "a.ints": [1, 2, 3],
    "a.floats": [0.5, 1.5],
    "a.bools": [True, False],
    "a.empty": [],
}


def _record_spans() -> list:
    """A parent and a child with every attribute type, events, a link and an error status."""
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_WORKER, rank=3, exporters=[memory])
    tracer = setup.get_tracer()
    with tracer.start_as_current_span("parent", kind=SpanKind.SERVER) as parent:
        parent.add_event("queued", {"depth": 2}, timestamp=1_000)
        parent.add_event("finished", timestamp=2_000)
        with tracer.start_as_current_span(
            "child",
            kind=SpanKind.PRODUCER,
            attributes=ATTRIBUTES,
            links=[Link(parent.get_span_context(), {"why": "test"})],
        ) as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
    setup.shutdown_tracing()
    return list(memory.get_finished_spans())


def _rows(store: TraceStore) -> dict[str, dict]:
    rows = store.query(f"SELECT {', '.join(COLUMNS)} FROM spans")
    for row in rows:
        for column in ("attributes", "events", "links", "resource"):
            row[column] = json.loads(row[column])
    return {row["name"]: row for row in rows}


def test_span_round_trip_keeps_every_attribute_type(tmp_path):
    recorded = _record_spans()
    store = TraceStore(tmp_path / "sdk.duckdb")
    store.insert_spans(recorded)
    rows = _rows(store)
    parent, child = rows["parent"], rows["child"]

    assert child["attributes"] == ATTRIBUTES
    assert child["kind"] == "PRODUCER" and parent["kind"] == "SERVER"
    assert child["status"] == "ERROR" and parent["status"] == "UNSET"
    assert child["parent_span_id"] == parent["span_id"]
    assert parent["parent_span_id"] is None
    assert child["trace_id"] == parent["trace_id"] and len(child["trace_id"]) == 32
    assert len(child["span_id"]) == 16
    assert child["links"] == [
        {
            "trace_id": parent["trace_id"],
            "span_id": parent["span_id"],
            "attributes": {"why": "test"},
        }
    ]
    assert parent["events"] == [
        {"name": "queued", "time_ns": 1_000, "attributes": {"depth": 2}},
        {"name": "finished", "time_ns": 2_000, "attributes": {}},
    ]
    assert child["service_name"] == n.SERVICE_WORKER and child["rank"] == 3
    assert child["resource"][n.RANK] == 3
    assert child["duration_ns"] == child["end_ns"] - child["start_ns"] >= 0


def test_otlp_and_sdk_paths_store_identical_rows(tmp_path):
    recorded = _record_spans()
    via_sdk = TraceStore(tmp_path / "sdk.duckdb")
    via_sdk.insert_spans(recorded)
    via_otlp = TraceStore(tmp_path / "otlp.duckdb")
    via_otlp.insert_otlp(encode_spans(recorded).SerializeToString())
    assert _rows(via_otlp) == _rows(via_sdk)


def test_span_dicts_insert_and_count(tmp_path):
    store = TraceStore(tmp_path / "dicts.duckdb")
    spans = [
        {
            "trace_id": f"{i:032x}",
            "span_id": f"{i:016x}",
            "name": n.ENGINE_STEP,
            "start_ns": 10 * i,
            "end_ns": 10 * i + 5,
            "attributes": {n.STEP: i, n.REQUEST_IDS: ["a"], n.REQUEST_NUM_TOKENS: [i]},
        }
        for i in range(1, 1001)
    ]
    assert store.insert_spans(spans) == 1000
    assert store.count() == 1000 == store.count(n.ENGINE_STEP)
    assert store.query("SELECT sum(num_tokens) AS s FROM step_requests")[0]["s"] == 500_500


def test_closed_file_opens_read_only_in_another_process(tmp_path):
    path = tmp_path / "done.duckdb"
    store = TraceStore(path)
    store.insert_spans(_record_spans())
    store.close()

    script = (
        "import duckdb, sys; con = duckdb.connect(sys.argv[1], read_only=True); "
        "print(con.execute('SELECT count(*) FROM spans').fetchone()[0], "
        "con.execute('SELECT count(*) FROM crossings').fetchone()[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["2", "0"]
    reader = TraceStore(path, read_only=True)
    assert reader.count() == 2
    with pytest.raises(duckdb.Error):
        reader.con.execute("DELETE FROM spans")


def test_read_only_open_of_a_non_trace_file_says_so(tmp_path):
    path = tmp_path / "other.duckdb"
    duckdb.connect(str(path)).close()
    with pytest.raises(ValueError, match="not a stepscope trace file"):
        TraceStore(path, read_only=True)


def test_in_process_run_queries_its_own_file_while_tracing(tmp_path):
    path = tmp_path / "live.duckdb"
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[DuckDBSpanExporter(path)])
    for step in range(10):
        with sp.step_span(step=step):
            pass
    setup.flush_tracing()
    live = TraceStore(path)  # this process owns the file: a second handle shares it
    assert live.count(n.ENGINE_STEP) == 10
    with sp.step_span(step=10):
        pass
    assert setup.shutdown_tracing() == 0
    assert live.query("SELECT max(step) AS m FROM steps")[0]["m"] == 10
    live.close()
    assert TraceStore(path, read_only=True).count() == 11
