"""The engine page over a real data-parallel run's trace (DP ranks 0 and 1, each with its own
steps 0, 1, ...): each rank's work, its lines over time, a rank at a time on the per-step charts
and the player, and the timeline's processes grouped by rank (no browser)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from stepscope.traces import names as n
from stepscope.viz.engine_data import load_series, rank_series, rank_table
from stepscope.viz.engine_page import EnginePage
from tests.traced_runs import DP2_PROMPTS


@pytest.fixture(scope="module")
def steps(dp2_source) -> pd.DataFrame:
    return dp2_source.query("SELECT * FROM steps ORDER BY start_ns")


@pytest.fixture(scope="module")
def page(dp2_source) -> EnginePage:
    return EnginePage(dp2_source, open_request=lambda rid: None)


def test_rank_series_has_one_line_per_rank(steps):
    origin = int(steps["start_ns"].min())
    data = rank_series(steps, origin)
    assert data["dp_rank"] == [0, 1] and data["label"] == ["DP rank 0", "DP rank 1"]
    assert data["color"][0] != data["color"][1]
    for i, dp_rank in enumerate(data["dp_rank"]):
        mine = steps[steps["dp_rank"] == dp_rank]
        assert len(mine) > 0
        for key in ("xs", "step", "budget", "kv_used", "running", "waiting"):
            assert len(data[key][i]) == len(mine), key
        assert list(data["step"][i]) == list(mine["step"])  # 0, 1, ... on each rank
        assert np.all(np.diff(data["xs"][i]) > 0) and data["xs"][i][0] >= 0
        tokens = mine["num_decode_tokens"] + mine["num_prefill_tokens"]
        np.testing.assert_allclose(data["budget"][i], tokens / mine["token_budget"] * 100)
        used = mine["kv_total_blocks"] - mine["kv_free_after"]
        np.testing.assert_array_equal(data["kv_used"][i], used)
        np.testing.assert_array_equal(data["running"][i], mine["num_running"])
        np.testing.assert_array_equal(data["waiting"][i], mine["num_waiting"])


def test_rank_table_counts_each_ranks_work(dp2_source, steps):
    requests = dp2_source.query("SELECT * FROM requests")
    table = rank_table(steps, requests)
    assert list(table["dp_rank"]) == [0, 1]
    assert table["requests"].sum() == len(DP2_PROMPTS) and (table["requests"] > 0).all()
    assert table["steps"].sum() == len(steps)
    assert table["output_tokens"].sum() == requests["output_tokens"].sum()


def test_load_chart_draws_what_the_coordinator_published(page, dp2_source):
    loads = dp2_source.query("SELECT * FROM dp_loads ORDER BY time_ns")
    loads = loads[loads["time_ns"] >= page.origin_ns]  # from the first request on
    assert len(loads) > 0
    lines = page.load_lines.data
    assert lines["dp_rank"] == [0, 1]
    for i, dp_rank in enumerate(lines["dp_rank"]):
        mine = loads[loads["dp_rank"] == dp_rank]
        assert list(lines["running"][i]) == list(mine["num_running"])
        assert list(lines["waiting"][i]) == list(mine["num_waiting"])
        xs = (mine["time_ns"] - page.origin_ns) / 1e6
        np.testing.assert_allclose(lines["xs"][i], xs, atol=1e-3)
    assert page.lost_points.data["x"] == []  # no rank was lost in this run
    assert "coordinator: waiting / running" in page.rank_summary.object


def test_a_lost_rank_gets_one_mark_where_it_was_first_published_lost():
    loads = pd.DataFrame(
        {
            "time_ns": [1_000_000, 1_000_000, 3_000_000, 3_000_000, 5_000_000, 5_000_000],
            "dp_rank": [0, 1, 0, 1, 0, 1],
            "num_waiting": [0, 0, 1, 0, 0, 0],
            "num_running": [2, 2, 2, 2, 1, 2],
            "lost": [False, False, False, True, False, True],
        }
    )
    lines, lost = load_series(loads, origin_ns=0)
    assert lines["dp_rank"] == [0, 1]
    assert list(lines["xs"][1]) == [1.0, 3.0, 5.0]
    assert lost["x"] == [3.0] and lost["label"] == ["DP rank 1 lost"]
    steps = pd.DataFrame(columns=["dp_rank", "num_decode_tokens", "num_prefill_tokens",
                                  "token_budget", "num_running", "num_waiting", "num_preempted",
                                  "duration_s"])  # fmt: skip
    requests = pd.DataFrame(columns=["dp_rank", "output_tokens", "ttft_s"])
    table = rank_table(steps, requests, loads).set_index("dp_rank")
    assert table.loc[0, "published_running"] == pytest.approx(5 / 3)
    assert not table.loc[0, "lost"] and table.loc[1, "lost"]


def test_page_shows_each_rank(page, dp2_source, steps):
    assert page.ranks == [0, 1]
    assert page.rank_box.visible and page.rank_select.visible
    assert list(page.rank_select.options.values()) == [0, 1]
    assert page.rank_lines.data["dp_rank"] == [0, 1]
    assert 'id="rank-0"' in page.rank_summary.object and 'id="rank-1"' in page.rank_summary.object
    assert 'id="ro-eng-ranks">2<' in page.summary.object
    assert f'id="ro-eng-steps">{len(steps)}<' in page.summary.object  # every rank's steps
    table = page.table.value
    assert len(table) == len(DP2_PROMPTS)
    routed = dp2_source.query("SELECT request_id, dp_rank FROM requests")
    assert dict(zip(table["request_id"], table["dp_rank"], strict=True)) == dict(
        zip(routed["request_id"], routed["dp_rank"], strict=True)
    )


@pytest.mark.parametrize("dp_rank", [1, 0])
def test_per_step_charts_and_player_show_one_rank(page, dp2_source, steps, dp_rank):
    page.rank_select.value = dp_rank
    mine = steps[steps["dp_rank"] == dp_rank]
    shown = pd.DataFrame(page.step_source.data)
    assert list(shown["step"]) == list(mine["step"])
    assert list(shown["running"]) == list(mine["num_running"])
    assert f"(DP rank {dp_rank})" in page.tokens_fig.title.text
    assert (page.player.start, page.player.end) == (0, int(mine["step"].max()))

    page.show_step(0)  # both ranks have a step 0: the detail is this rank's
    assert f"<b>DP rank {dp_rank}, step 0</b>:" in page.step_detail.object
    served = dp2_source.query(
        "SELECT request_id, num_tokens FROM step_requests WHERE dp_rank = $1 AND step = 0",
        [dp_rank],
    )
    other = dp2_source.query(
        "SELECT request_id FROM step_requests WHERE dp_rank <> $1 AND step = 0", [dp_rank]
    )
    detail = page.step_detail.object.split("requests (tokens):")[1]
    for rid, k in zip(served["request_id"], served["num_tokens"], strict=True):
        assert f"{rid} ({k})" in detail
    for rid in other["request_id"]:
        assert f"{rid} (" not in detail
    start_ns = int(mine.loc[mine["step"] == 0, "start_ns"].iloc[0])
    assert page.timeline_step.left == pytest.approx((start_ns - page.origin_ns) / 1e6)
    assert all(m.visible for m in page.rank_markers)


def test_timeline_groups_processes_by_rank(page):
    page.rank_select.value = 0
    page.show_step(2)
    lanes = set(page.lane_bars.data["lane"])
    assert {"DP 0 · engine core", "DP 0 · worker 0"} <= lanes
    factors = list(reversed(page.timeline_fig.y_range.factors))  # top to bottom
    assert factors[0] == "API server"
    ranks = [f.split(" · ")[0] for f in factors[1:]]
    assert ranks == sorted(ranks) and {"DP 0", "DP 1"} <= set(ranks)  # each rank's lanes together
    links = pd.DataFrame(page.lane_links.data)
    sent = links[links["boundary"] == n.API_TO_ENGINE_CORE]
    assert set(sent["y0"]) == {"API server"} and set(sent["y1"]) <= {
        "DP 0 · engine core",
        "DP 1 · engine core",
    }


def test_request_path_page_names_the_requests_rank(dp2_source):
    from stepscope.viz.path_page import RequestPathPage

    routed = dp2_source.query("SELECT request_id, dp_rank FROM requests ORDER BY dp_rank DESC")
    rid, dp_rank = routed["request_id"].iloc[0], int(routed["dp_rank"].iloc[0])
    path = RequestPathPage(dp2_source)
    path.show(rid)
    assert f'id="ro-req-dp-rank">{dp_rank}<' in path.header.object
    assert dp_rank == 1 and 'id="stage-10"' in path.stages.object
