"""The engine page's data module on a real run's trace, without Panel: what it reads and the
columns it shapes for the page's charts, table and timeline."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from stepscope.viz import engine_data as data


def test_engine_data_imports_without_panel_or_bokeh():
    code = (
        "import sys, stepscope.viz.engine_data\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'panel', 'bokeh'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_steps_and_requests_shape_into_the_charts_and_table_columns(source, traced_tp2_run):
    info = traced_tp2_run.info
    steps, requests = data.read_steps(source), data.read_requests(source)
    assert len(steps) == info["steps"] and len(requests) == info["requests"]
    assert data.ranks_in(steps, requests) == [0]

    series, marks, top = data.step_series(steps)
    assert tuple(series) == data.STEP_COLUMNS
    assert all(len(values) == len(steps) for values in series.values())
    assert set(marks) == {"step", "y", "count"} and marks["count"].sum() == info["preemptions"]
    assert series["prefill"].max() == info["max_prefill"] and top > series["prefill"].max()

    table = data.request_table(requests, several_ranks=False)
    assert list(table.columns) == [
        "request_id",
        "prompt",
        "output",
        "cached",
        "queue_ms",
        "ttft_ms",
        "itl_ms",
        "e2e_ms",
        "preemptions",
        "finish",
    ]
    assert set(table["request_id"]) == set(requests["request_id"])
    assert (table["preemptions"] > 0).any()
    hists = data.latency_histograms(requests)
    assert set(hists) == set(data.LATENCIES)
    assert sum(hists["ttft"]["count"]) == info["requests"]
    keys = [key for key, _, _ in data.step_cards(steps, 1) + data.request_cards(requests)]
    assert "eng-steps" in keys and "eng-requests" in keys and "eng-ranks" not in keys

    ranks = data.rank_table(steps, requests, data.read_loads(source))
    assert list(ranks["dp_rank"]) == [0] and ranks["steps"].iloc[0] == info["steps"]
    assert set(data.rank_series(steps, int(steps["start_ns"].min()))) >= {"xs", "budget", "kv_used"}


def test_timeline_shapes_lanes_and_links(source):
    steps = data.read_steps(source)
    origin = int(steps["start_ns"].min())
    t0, t1 = data.timeline_window(steps, None, origin)
    assert t0 <= origin < t1
    spans, links = data.read_timeline(source, t0, t1)
    bars = data.timeline_bars(spans, origin, several_ranks=False)
    assert set(bars) == {"lane", "left", "right", "kind", "label", "step"}
    assert set(bars["lane"]) == {"engine core", "worker 0", "worker 1"}
    assert np.all(bars["right"] >= bars["left"])
    segments = data.timeline_links(links, origin, several_ranks=False)
    assert set(segments) == {"x0", "y0", "x1", "y1", "boundary", "label"}
    lanes = data.timeline_lanes(bars, segments, [0], several_ranks=False)
    assert lanes[-1] == "API server" and set(bars["lane"]) <= set(lanes)
    served = data.read_step_requests(source, 0, int(steps["step"].iloc[0]))
    assert list(served.columns) == ["request_id", "num_tokens"] and len(served) > 0
