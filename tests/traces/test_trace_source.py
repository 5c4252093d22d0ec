"""One trace reader: a running collector's URL and the file it saves read the same.

The trace factory's run (tests/viz/trace_factory.py: the real engine core and API-side code, a
pretend model) goes to a real collector process over OTLP/HTTP, as the engine's processes send
it. The trace is read from the collector's URL while it runs, then from its file once closed:
the views come back with the same column dtypes and the same numbers, and `stepscope trace
explain` prints the same answer.
"""

from __future__ import annotations

import pandas as pd
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from stepscope.traces.backend import queries
from stepscope.traces.backend.client import CollectorClient
from stepscope.traces.backend.collector_process import stop_collector_process
from stepscope.traces.backend.source import CollectorSource, DuckDBSource, open_trace
from tests.server_utils import CLI
from tests.viz.trace_factory import record_workload

VIEWS = ("requests", "steps", "crossings", "step_requests", "worker_steps", "dp_loads")


@pytest.fixture(scope="module")
def run_spans() -> list:
    return record_workload()[0]


def send(url: str, spans: list) -> None:
    """The spans into the collector at `url` through the SDK's OTLP/HTTP exporter, flushed."""
    exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces")
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    stats = CollectorClient(url).flush()
    assert stats["flushed"] and stats["inserted"] == len(spans)


def read_views(path_or_url: str) -> tuple[dict[str, pd.Series], dict[str, pd.DataFrame]]:
    """Each view's column dtypes, and the summary's tables."""
    with open_trace(path_or_url) as source:
        dtypes = {view: source.df(f"SELECT * FROM {view}").dtypes for view in VIEWS}
        return dtypes, queries.summary(source)


def test_a_collector_url_and_its_saved_file_give_the_same_columns(collector, run_spans):
    process, url, db_path = collector
    send(url, run_spans)
    with open_trace(url) as live:
        assert isinstance(live, CollectorSource) and live.live
    live_dtypes, live_summary = read_views(url)
    stop_collector_process(process)
    with open_trace(db_path) as saved:
        assert isinstance(saved, DuckDBSource) and not saved.live
    saved_dtypes, saved_summary = read_views(db_path)

    for view in VIEWS:
        pd.testing.assert_series_equal(live_dtypes[view], saved_dtypes[view], obj=view)
    # Integers stay integers over HTTP (JSON rows would have made objects or floats of them).
    assert pd.api.types.is_integer_dtype(live_dtypes["steps"]["num_running"])
    assert pd.api.types.is_integer_dtype(live_dtypes["crossings"]["bytes"])
    for table in saved_summary:
        pd.testing.assert_frame_equal(live_summary[table], saved_summary[table], obj=table)
    assert saved_summary["spans"]["spans"].sum() == len(run_spans)


def test_trace_explain_prints_the_same_from_a_collector_url_and_its_file(
    collector, run_spans, process_tree
):
    process, url, db_path = collector
    send(url, run_spans)
    live = process_tree.run([*CLI, "trace", "explain", url], timeout=120)
    stop_collector_process(process)
    saved = process_tree.run([*CLI, "trace", "explain", db_path], timeout=120)

    assert live.returncode == 0, live.stderr
    assert saved.returncode == 0, saved.stderr
    first = saved.stdout.splitlines()[0]
    assert first.startswith("request ") and "end-to-end" in first
    assert "where the time went" in saved.stdout and "\nwhy\n" in saved.stdout
    assert live.stdout == saved.stdout  # the same request, parts, steps and sentence
