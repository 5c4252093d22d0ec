"""Blocks held per KV cache group on the engine page and the simulator page: a hybrid model's
steps (the real scheduler and KV cache manager with Gemma 3's layer pattern, as the simulator
drives them) recorded through the real step-span helper into a trace file, then read as the
dashboard reads it; a one-group run's page stays as it was (no browser)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd
import pytest

from stepscope.engine.core.scheduler import StepStats
from stepscope.traces import names as n
from stepscope.traces import setup
from stepscope.traces import spans as sp
from stepscope.traces.backend.source import DuckDBSource
from stepscope.traces.backend.store import DuckDBSpanExporter
from stepscope.viz import engine_data as data
from stepscope.viz.engine_page import EnginePage
from stepscope.viz.simulator import GEMMA3_LAYERS, SimStep, simulate_steps
from stepscope.viz.simulator_page import SimulatorPage

LABELS = ["full attention"] + [f"sliding window 512 (group {k})" for k in range(1, 6)]


@pytest.fixture(scope="module")
def hybrid_steps() -> list[SimStep]:
    return simulate_steps(
        running=2, prompt_len=2000, free_blocks=800, budget=256, block_size=32, num_steps=30,
        output_len=16, layer_types=GEMMA3_LAYERS, sliding_window=512,
    )  # fmt: skip


@pytest.fixture(scope="module")
def hybrid_source(tmp_path_factory, hybrid_steps) -> Iterator[DuckDBSource]:
    """The simulated steps as engine step spans in a closed DuckDB file."""
    path = str(tmp_path_factory.mktemp("kv-groups") / "run.duckdb")
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[DuckDBSpanExporter(path)])
    for s in hybrid_steps:
        stats = StepStats(
            s.step, s.num_running, s.num_waiting, s.decode_tokens, s.prefill_tokens, 256,
            s.kv_free_before, s.kv_free_after, s.prefix_hit_tokens, s.preempted, s.finished,
            kv_blocks_by_group=s.kv_blocks_by_group, kv_group_windows=s.kv_group_windows,
        )  # fmt: skip
        with sp.step_span(step=s.step) as span:
            span.record(stats, s.scheduled, kv_total_blocks=2 * 6 + 800)
    assert setup.shutdown_tracing() == 0
    src = DuckDBSource(path)
    yield src
    src.close()


def test_group_series_has_one_line_per_group_named_by_its_window(hybrid_source, hybrid_steps):
    steps = data.read_steps(hybrid_source)
    series = data.kv_group_series(steps)
    assert series["label"] == LABELS
    assert len(set(series["color"])) == 6
    for k in range(6):
        np.testing.assert_array_equal(series["xs"][k], [s.step for s in hybrid_steps])
        np.testing.assert_array_equal(
            series["ys"][k], [s.kv_blocks_by_group[k] for s in hybrid_steps]
        )
    # The sliding-window groups end far below the full-attention group.
    assert max(series["ys"][1]) < max(series["ys"][0]) / 2


def test_group_series_of_hand_made_frames():
    one_group = pd.DataFrame({"step": [0, 1], "kv_blocks_by_group": [[3], [4]]})
    assert data.kv_group_series(one_group)["xs"] == []
    assert data.kv_group_series(pd.DataFrame({"step": [0]}))["xs"] == []  # an older trace
    # No windows recorded (and a step without groups): the groups are named by index.
    frame = pd.DataFrame({"step": [0, 1], "kv_blocks_by_group": [None, [5, 2]]})
    series = data.kv_group_series(frame)
    assert series["label"] == ["group 0", "group 1"]
    np.testing.assert_array_equal(series["ys"][0], [np.nan, 5])
    assert data.kv_group_labels([0, 0, 512], 3) == [
        "full attention (group 0)",
        "full attention (group 1)",
        "sliding window 512 (group 2)",
    ]


def test_engine_page_draws_the_groups_of_a_hybrid_run(hybrid_source):
    page = EnginePage(hybrid_source, open_request=lambda rid: None)
    assert page.groups_box.visible
    assert page.groups_source.data["label"] == LABELS
    page.show_step(3)
    assert page.markers[-1].visible and page.markers[-1].location == 3


def test_engine_page_of_a_one_group_run_has_no_group_chart(source):
    page = EnginePage(source, open_request=lambda rid: None)
    assert data.kv_group_series(data.read_steps(source))["xs"] == []
    assert not page.groups_box.visible and page.groups_source.data["xs"] == []


def test_simulator_page_draws_the_groups_of_gemma3_layers():
    page = SimulatorPage()
    assert not page.groups_box.visible and "blocks per group" not in page.steps_table.value
    page.apply_preset("Gemma 3 layers: windows give blocks back")
    assert page.layers.value == "Gemma 3: 5 local : 1 global, window 512"
    assert page.groups_box.visible and page.groups_source.data["label"] == LABELS
    assert "6 KV cache groups ×" in page.readouts.object
    assert "sliding window 512 (group 1) = sliding window 512 (group 2)" in page.story.object
    assert "blocks per group" in page.steps_table.value
    page.layers.value = "All full attention"
    assert not page.groups_box.visible
