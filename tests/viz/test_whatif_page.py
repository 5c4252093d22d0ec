"""The dashboard's What if page without a browser: its sliders start at the real TP=2 run's
recorded settings, and moving one changes the numbers it shows to whatif's prediction for the
new setting, the trace read once; a trace it cannot predict shows why, and a live one is read
again with the page's button. The browser test is in test_dashboard_browser.py."""

from __future__ import annotations

import re

import pytest

from stepscope.traces.backend.compare import metric_text, recorded_table
from stepscope.traces.backend.source import StoreSource
from stepscope.traces.backend.store import TraceStore
from stepscope.viz.whatif import load_trace
from stepscope.viz.whatif_page import READOUTS, WhatIfPage, knob_range
from tests.viz.test_whatif import starve_steps


def shown(page: WhatIfPage) -> dict[str, str]:
    """The predicted readouts as the page shows them, by element id."""
    return dict(re.findall(r'id="(ro-wi-[a-z0-9-]+)">([^<]*)<', page.readouts.object))


def expected(table: dict) -> dict[str, str]:
    return {element: metric_text(key, table[key]) for key, (element, _) in READOUTS.items()}


def test_a_slider_move_shows_the_prediction_for_the_new_setting(source):
    page = WhatIfPage(source)
    assert page.content.visible and not page.problem.visible
    loaded = page.loaded
    recorded = page.recorded_values()
    # tests/traced_runs.py records the TP=2 run with a 64-token budget and 14 KV blocks.
    assert page.values() == recorded
    assert recorded["max_num_batched_tokens"] == 64 and recorded["num_kv_blocks"] == 14
    assert loaded.recorded == recorded_table(source)
    at_recorded = load_trace(source).predict({})  # read afresh: the page's numbers
    assert shown(page) == expected(at_recorded.table)

    page.sliders["max_num_seqs"].value = 1  # one request at a time
    one_at_a_time = load_trace(source).predict({**recorded, "max_num_seqs": 1}).table
    assert shown(page) == expected(one_at_a_time)
    assert one_at_a_time["ttft_p90_s"] > at_recorded.table["ttft_p90_s"]
    assert "max_num_seqs" in page.table.object and "1 (recorded" in page.status.object
    bars = page.latency_source.data
    these = [s for x, s in zip(bars["x"], bars["seconds"], strict=True)
             if x[1] == "predicted, these settings"]  # fmt: skip
    assert these == [one_at_a_time[k] for k in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s",
                                                 "e2e_p90_s")]  # fmt: skip
    assert ("max_num_seqs", "predicted, these settings") in page.queue_source.data["y"]
    assert page.loaded is loaded  # the trace was read and the model fitted once

    page.set_values(recorded)
    assert shown(page) == expected(at_recorded.table)
    assert "the recorded settings" in page.status.object


def test_a_setting_the_engine_would_refuse_says_why(source):
    page = WhatIfPage(source)
    pool = page.sliders["num_kv_blocks"]
    pool.param.update(start=1)
    pool.value = 1  # 16 tokens of KV cache: no recorded prompt fits
    assert page.error.visible and "does not fit the context" in page.error.object
    assert set(shown(page).values()) == {"-"}


def test_a_trace_it_cannot_predict_says_why_and_a_live_one_is_read_again(source, tmp_path):
    store = TraceStore(tmp_path / "live.duckdb")  # as a collector's: no span yet
    try:
        page = WhatIfPage(StoreSource(store))
        assert page.loaded is None and page.problem.visible and not page.content.visible
        assert "recorded before replay existed" in page.problem.object
        assert "read the trace again" in page.problem.object and page.reload.visible
        add_spans(store, source)  # the TP=2 run arrives
        page.reload.clicks += 1
        assert page.loaded is not None and page.content.visible and not page.problem.visible
        assert shown(page) == expected(page.loaded.predict({}).table)
    finally:
        store.close()


@pytest.fixture
def store(tmp_path):
    """A trace store of this test's own, as a collector's: spans go in while the page reads."""
    store = TraceStore(tmp_path / "own.duckdb")
    yield store
    store.close()


def add_spans(store: TraceStore, source, times: int = 1) -> None:
    """The TP=2 run's spans into `store`, `times` times over."""
    store.con.register("recorded", source.df("SELECT * FROM spans"))
    for _ in range(times):
        store.con.execute("INSERT INTO spans SELECT * FROM recorded")


def test_a_trace_holding_two_runs_says_so(source, store):
    add_spans(store, source, times=2)  # the same process's run again into the same file
    page = WhatIfPage(StoreSource(store))
    assert page.loaded is None and page.problem.visible and not page.content.visible
    assert "holds 2 runs" in page.problem.object and "its own file" in page.problem.object


def test_the_fit_text_names_the_steps_left_out_for_contention(source, store):
    add_spans(store, source)
    starve_steps(store, (1, 2))  # their workers got no CPU to speak of
    page = WhatIfPage(StoreSource(store))
    assert page.content.visible and page.loaded.model.steps_left_out == 2
    assert "2 of " in page.model_text.object
    assert "steps left out of the fit" in page.model_text.object


@pytest.mark.parametrize(
    ("recorded", "low", "high", "want"),
    [(64, 16, 256, (16, 256, 1)), (2048, 16, 8192, (32, 8192, 32)), (5, 9, 20, (5, 20, 1))],
)
def test_slider_range_keeps_the_recorded_value_on_its_grid(recorded, low, high, want):
    start, end, step = knob_range(recorded, low, high)
    assert (start, end, step) == want
    assert (recorded - start) % step == 0 and (end - start) / step <= 256
