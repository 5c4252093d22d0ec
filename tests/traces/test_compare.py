"""`stepscope trace compare`: the run's table from per-request times, checked against numbers
computed here straight from the views of a real run (the session's TP=2 run: requests that
queue, share a prefix and are preempted), and the CLI side by side."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from stepscope.engine.entrypoints.cli.main import main
from stepscope.traces.backend.compare import (
    METRICS,
    RequestTimes,
    nearest_rank,
    ratios,
    recorded_table,
    run_table,
    trace_compare,
)
from stepscope.traces.backend.explain import explain


def times(rid: str, start: float, first: float, finished: float, end: float, out: int,
          **extra: object) -> RequestTimes:  # fmt: skip
    s = 1_000_000_000
    return RequestTimes(rid, int(start * s), int(first * s), int(finished * s), int(end * s), out,
                        **extra)  # fmt: skip


def test_nearest_rank_takes_the_value_at_rank_ceil_p_n() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert nearest_rank(values, 50) == 3.0  # rank ceil(2.5) = 3
    assert nearest_rank(values, 90) == 5.0  # rank ceil(4.5) = 5
    assert nearest_rank(values, 20) == 1.0  # rank 1 exactly
    assert nearest_rank([], 50) is None


def test_run_table_from_hand_made_requests() -> None:
    requests = [
        times("a", 0.0, 1.0, 3.0, 3.5, 5, preemptions=1, queue_s_by_reason={"budget": 0.25}),
        times("b", 1.0, 1.5, 1.5, 2.0, 1, queue_s_by_reason={"budget": 0.5, "kv_blocks": 1.0}),
        times("c", 2.0, 4.0, 6.0, 6.0, 3),
    ]
    table = run_table(requests)
    assert list(table) == list(METRICS)
    assert table["ttft_p50_s"] == 1.0  # TTFTs 1.0, 0.5, 2.0
    assert table["ttft_p90_s"] == table["ttft_p99_s"] == 2.0
    assert table["tpot_mean_s"] == pytest.approx((2.0 / 4 + 2.0 / 2) / 2)  # b has one token
    assert table["e2e_p50_s"] == 3.5 and table["e2e_p90_s"] == 4.0  # 3.5, 1.0, 4.0
    assert table["throughput_tok_s"] == pytest.approx(9 / 6.0)  # last finish 6 - first arrival 0
    assert table["preemptions"] == 1
    assert table["queue_s_by_reason"] == {"budget": 0.75, "kv_blocks": 1.0}


def test_ratios_are_b_over_a_and_none_where_a_is_zero() -> None:
    a = run_table([times("a", 0, 1, 2, 2, 3, queue_s_by_reason={"budget": 1.0})])
    b = run_table([times("a", 0, 2, 4, 4, 3, preemptions=2, queue_s_by_reason={"kv": 1.0})])
    r = ratios(a, b)
    assert r["ttft_p50_s"] == 2.0 and r["throughput_tok_s"] == 0.5
    assert r["preemptions"] is None  # A had none
    assert r["queue_s_by_reason"] == {"budget": 0.0, "kv": None}


def test_table_matches_numbers_computed_from_the_views(tp2_store) -> None:
    req = tp2_store.df("SELECT * FROM requests")
    table = recorded_table(tp2_store)

    def rank(values: np.ndarray, p: int) -> float:  # nearest rank, as numpy names it
        return float(np.percentile(values, p, method="inverted_cdf"))

    ttft = req["ttft_s"].dropna().to_numpy()
    e2e = req["e2e_s"].to_numpy()
    for p in (50, 90, 99):
        assert table[f"ttft_p{p}_s"] == pytest.approx(rank(ttft, p), abs=1e-6)
    for p in (50, 90):
        assert table[f"e2e_p{p}_s"] == pytest.approx(rank(e2e, p), abs=1e-6)
    many = req[req["output_tokens"] > 1]
    tpot = (many["finished_ns"] - many["first_token_ns"]) / 1e9 / (many["output_tokens"] - 1)
    assert table["tpot_mean_s"] == pytest.approx(tpot.mean(), abs=1e-6)
    span = (req["finished_ns"].max() - req["start_ns"].min()) / 1e9
    assert table["throughput_tok_s"] == pytest.approx(req["output_tokens"].sum() / span, rel=1e-4)
    assert table["preemptions"] == req["num_preemptions"].sum() > 0
    # Queue time by reason: explain's answer for each request, summed.
    summed: dict[str, float] = {}
    for rid in req["request_id"]:
        for reason, seconds in explain(tp2_store, rid)["queue_reasons"].items():
            summed[reason] = summed.get(reason, 0.0) + seconds
    assert set(table["queue_s_by_reason"]) == set(summed)
    for reason, seconds in summed.items():
        assert table["queue_s_by_reason"][reason] == pytest.approx(seconds, abs=1e-5)
    assert math.fsum(summed.values()) == pytest.approx(req["queue_time_s"].sum(), abs=1e-4)


def test_cli_compare_json_has_both_runs_ratios_and_each_request(traced_tp2_run, capsys) -> None:
    path = traced_tp2_run.path
    main(["trace", "compare", path, path, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"a", "b", "ratio", "requests"}
    assert list(result["a"]) == list(METRICS) and result["a"] == result["b"]
    assert all(v in (1.0, None) for k, v in result["ratio"].items() if k != "queue_s_by_reason")
    assert len(result["requests"]) == traced_tp2_run.info["requests"]
    first = result["requests"][0]
    assert first["a"] == first["b"] and first["a"]["request_id"]
    assert set(first["a"]) == {"request_id", "ttft_s", "tpot_s", "e2e_s", "queue_s",
                               "output_tokens", "preemptions"}  # fmt: skip


def test_cli_compare_prints_times_people_read(traced_tp2_run) -> None:
    out = io.StringIO()
    assert trace_compare(traced_tp2_run.path, traced_tp2_run.path, out=out) == 0
    text = out.getvalue()
    for label in ("ttft_p50", "tpot_mean", "e2e_p90", "throughput", "preemptions", "queue: "):
        assert label in text
    assert "e+" not in text and "e-" not in text
    assert " s " in text or " ms " in text
