"""The ten stages measured from a real run's trace file, the trace sources, and the app's pages
built over it (no browser)."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pandas as pd
import pytest

from stepscope.traces import names as n
from stepscope.traces.backend.source import DuckDBSource
from stepscope.viz.request_path import STAGES, stage_occurrences, stage_summary


def test_ten_stages_cover_the_four_boundaries_once_each():
    assert [s.number for s in STAGES] == list(range(1, 11))
    crossing = [s for s in STAGES if "->" in s.process]
    assert [s.crosses.split()[0] for s in crossing] == [
        "EngineCoreRequest",
        "SchedulerOutput",
        "ModelRunnerOutput",
        "EngineCoreOutputs",
    ]
    assert "never text" in STAGES[8].action


def test_the_guide_lists_the_same_ten_stages_as_the_dashboard():
    guide = Path(__file__).resolve().parents[2] / "docs" / "request-path.md"
    rows = re.findall(r"^\| (\d+) \| ([^|]+?) \| ([^|]+?) \|", guide.read_text(), re.MULTILINE)
    assert [(int(num), name) for num, name, _ in rows] == [(s.number, s.name) for s in STAGES]
    for (_, _, process), stage in zip(rows, STAGES, strict=True):
        expected = "boundary" if "->" in stage.process else stage.process
        assert process.startswith(expected), (stage.name, process)


def _first_request(source) -> str:
    return source.query("SELECT request_id FROM requests ORDER BY start_ns LIMIT 1").iloc[0, 0]


def test_every_stage_is_measured_for_a_request(source):
    request, occ = stage_occurrences(source, _first_request(source))
    assert set(occ["stage"]) == set(range(1, 11))
    assert (occ["end_ns"] >= occ["start_ns"]).all()
    served = occ.loc[occ["stage"] == 4, "step"].nunique()
    assert served >= request["output_tokens"]  # at least one step per output token
    # Each step: one schedule and update, one core->worker crossing and forward per rank (TP=2).
    for stage, per_step in ((4, 1), (5, 2), (6, 2), (7, 1), (8, 1)):
        assert (occ["stage"] == stage).sum() == served * per_step, stage
    assert set(occ.loc[occ["stage"] == 6, "rank"]) == {0, 1}
    # Stages happen in order within the request's life.
    first = occ.groupby("stage")["start_ns"].min()
    assert first[1] <= first[2] <= first[4] <= first[5] <= first[6] <= first[8] <= first[10]
    # The waiting queue starts once the engine core has the request, not before.
    assert first[3] >= occ.loc[occ["stage"] == 2, "end_ns"].min()
    assert occ["start_ns"].min() >= request["start_ns"]
    # A worker step (stage 6) holds its own reply's send (rank 0), and another rank may end its
    # last forward later still: on a loaded machine the API side can end the request first.
    caused = occ[occ["stage"] != 6]
    assert caused["end_ns"].max() <= request["end_ns"]
    assert occ["start_ns"].max() <= request["end_ns"]


def test_preempted_request_waits_again(source):
    preempted = source.query("SELECT request_id FROM requests WHERE num_preemptions > 0")
    assert len(preempted), "the trace fixture must contain a preemption"
    _, occ = stage_occurrences(source, preempted["request_id"].iloc[0])
    waits = occ[occ["stage"] == 3]
    assert len(waits) >= 2
    assert "preemption" in waits["detail"].iloc[-1]


def test_stage_summary_has_one_row_per_stage(source):
    _, occ = stage_occurrences(source, _first_request(source))
    summary = stage_summary(occ)
    assert list(summary["stage"]) == list(range(1, 11))
    assert (summary["times"] >= 1).all()
    assert summary["total_ms"].sum() > 0


def test_unknown_request_is_a_key_error(source):
    with pytest.raises(KeyError):
        stage_occurrences(source, "no-such-request")


def test_duckdb_source_is_read_only_and_checks_the_file(tmp_path, traced_tp2_run):
    src = DuckDBSource(traced_tp2_run.path)
    try:
        assert not src.live
        requests = src.query("SELECT count(*) AS n FROM requests")["n"].iloc[0]
        assert requests == traced_tp2_run.info["requests"]
        with pytest.raises(Exception, match="read-only"):
            src.query("CREATE TABLE x (a INTEGER)")
    finally:
        src.close()
    import duckdb

    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).close()
    with pytest.raises(ValueError, match="not a stepscope trace file"):
        DuckDBSource(other)


def test_app_pages_read_the_trace(source, traced_tp2_run):
    from stepscope.viz import app

    info = traced_tp2_run.info
    page = app.build_app(source)
    assert page.title == "stepscope"
    engine = app.EnginePage(source, open_request=lambda rid: None)
    table = engine.table.value
    ids = set(source.query("SELECT request_id FROM requests")["request_id"])
    assert len(table) == info["requests"] and set(table["request_id"]) == ids
    steps = pd.DataFrame(engine.step_source.data)
    assert len(steps) == info["steps"]
    assert steps["preempted"].sum() == info["preemptions"]
    assert steps["prefill"].max() == info["max_prefill"]
    assert "eng-requests" in engine.summary.object
    lanes = set(engine.lane_bars.data["lane"])
    assert lanes == {"engine core", "worker 0", "worker 1"}
    # One DP rank: no rank table, lines, selector or column (tests/viz/test_engine_page_ranks.py).
    assert not engine.rank_box.visible and not engine.rank_select.visible
    assert "dp_rank" not in table.columns
    boundaries = set(engine.lane_links.data["boundary"])
    assert boundaries == {
        n.API_TO_ENGINE_CORE,
        n.ENGINE_CORE_TO_WORKER,
        n.WORKER_TO_ENGINE_CORE,
        n.ENGINE_CORE_TO_API,
    }

    engine.show_step(3)
    assert "<b>step 3</b>:" in engine.step_detail.object
    assert all(marker.location == 3 for marker in engine.markers)

    path = app.RequestPathPage(source)
    assert len(path.select.options) == info["requests"]
    rid = _first_request(source)
    path.show(rid)
    assert 'id="stage-10"' in path.stages.object
    assert f'id="ro-req-id">{rid}<' in path.header.object
    # "Why this long": the same answer as `stepscope trace explain`, its parts stacked end to end.
    from stepscope.traces.backend.explain import explain

    answer = explain(source, rid)
    assert html.escape(answer["summary"]) in path.why_text.object
    bars = path.why_parts.data
    # explain rounds each part to the microsecond: their sum is e2e within a few microseconds.
    assert bars["left"][0] == 0
    assert bars["right"][-1] == pytest.approx(answer["e2e_s"] * 1e3, abs=0.01)


def test_app_without_a_trace_says_how_to_get_one():
    from stepscope.viz import app

    engine = app.EnginePage(None, open_request=lambda rid: None)
    assert engine.empty.visible and "stepscope serve --trace-db" in engine.empty.object
    path = app.RequestPathPage(None)
    assert path.empty.visible and "trace_db=" in path.empty.object
    app.build_app(None)
