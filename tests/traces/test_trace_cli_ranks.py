"""A real data-parallel run's trace (two engine-core processes, DP ranks 0 and 1): the summary's
work per rank, and a request's steps and crossings read on its own rank (step indexes count per
rank, so both ranks have a step 0)."""

from __future__ import annotations

import io
from pathlib import Path

from stepscope.traces.backend import cli, queries
from stepscope.traces.backend.store import TraceStore
from tests.traced_runs import DP2_MAX_TOKENS, DP2_PROMPTS


def test_both_ranks_ran_a_step_0(dp2_store):
    steps = dp2_store.df("SELECT dp_rank, step FROM steps WHERE step = 0 ORDER BY dp_rank")
    assert list(steps["dp_rank"]) == [0, 1]
    assert queries.dp_ranks(dp2_store) == [0, 1]


def test_summary_has_one_row_per_rank_that_adds_up(dp2_store):
    tables = queries.summary(dp2_store)
    ranks = tables["ranks"]
    assert list(ranks["dp_rank"]) == [0, 1]
    assert ranks["requests"].sum() == len(DP2_PROMPTS) and (ranks["requests"] > 0).all()
    assert ranks["output_tokens"].sum() == len(DP2_PROMPTS) * DP2_MAX_TOKENS
    routed = dp2_store.df("SELECT dp_rank, count(*) AS n, sum(input_tokens) AS tokens "
                          "FROM requests GROUP BY dp_rank ORDER BY dp_rank")  # fmt: skip
    assert list(ranks["requests"]) == list(routed["n"])
    assert list(ranks["input_tokens"]) == list(routed["tokens"])
    assert ranks["steps"].sum() == tables["steps"]["steps"][0]
    assert ranks["preemptions"].sum() == tables["steps"]["preemptions"][0]
    assert ranks["max_running"].max() == tables["steps"]["max_running"][0]
    assert ((ranks["mean_budget_used"] > 0) & (ranks["mean_budget_used"] <= 1)).all()
    assert (ranks["mean_step_ms"] > 0).all()
    assert (ranks["p50_ttft_ms"] <= ranks["p99_ttft_ms"]).all()


def test_the_coordinators_publications_are_one_row_per_rank(dp2_store):
    loads = dp2_store.df("SELECT * FROM dp_loads ORDER BY time_ns, dp_rank")
    spans = dp2_store.df(
        "SELECT service_name, count(*) AS n FROM spans WHERE name = 'stepscope.dp_publish' "
        "GROUP BY 1"
    )
    assert list(spans["service_name"]) == ["stepscope.dp_coordinator"]
    publications = int(spans["n"][0])
    assert publications >= 1 and len(loads) == 2 * publications
    per_time = loads.groupby("time_ns")["dp_rank"].apply(list)
    assert all(ranks == [0, 1] for ranks in per_time)  # every publication names both ranks
    assert not loads["lost"].any()
    # Each rank's last report is never older than the 3 s after which it would be lost.
    assert loads["report_age_s"].between(-0.001, 3.0).all()
    # The coordinator saw the burst: some publication counts requests on a rank. Only the
    # engine cores' own counts went in: nothing above what their steps recorded.
    published = loads.groupby("dp_rank")[["num_running", "num_waiting"]].max()
    assert (published["num_running"] + published["num_waiting"]).max() > 0
    recorded = dp2_store.df("SELECT dp_rank, max(num_running + num_waiting) AS most FROM steps "
                            "GROUP BY 1 ORDER BY 1")  # fmt: skip
    assert (published["num_running"] <= len(DP2_PROMPTS)).all()
    assert published.sum(axis=1).max() <= max(recorded["most"].max(), len(DP2_PROMPTS))
    ranks = queries.summary(dp2_store)["ranks"]
    assert list(ranks["publications"]) == [publications, publications]
    assert not ranks["lost"].any()


def test_cli_prints_work_per_dp_rank(traced_dp2_run):
    out = io.StringIO()
    cli.trace_summary(traced_dp2_run, out=out)
    text = out.getvalue()
    assert "work per DP rank" in text and "engine steps (all DP ranks)" in text
    table = text.split("work per DP rank")[1].split("\n\n")[0].splitlines()[1:]
    assert table[0].split()[:3] == ["dp_rank", "requests", "output_tokens"]
    rows = [line.split() for line in table[1:]]
    assert [r[0] for r in rows] == ["0", "1"]
    assert sum(int(r[1]) for r in rows) == len(DP2_PROMPTS)
    latest = text.split("latest requests")[1].splitlines()[1]
    assert latest.split()[-1] == "dp_rank"


def test_request_steps_are_its_own_ranks(dp2_store, traced_dp2_run):
    requests = dp2_store.df("SELECT request_id, dp_rank FROM requests")
    for rid, dp_rank in zip(requests["request_id"], requests["dp_rank"], strict=True):
        path = queries.request_path(dp2_store, rid)
        served = dp2_store.df(
            "SELECT step, start_ns FROM step_requests WHERE request_id = $1 ORDER BY start_ns",
            [rid],
        )
        assert list(path.steps["start_ns"]) == list(served["start_ns"])
        assert set(path.steps["dp_rank"]) == {dp_rank}
        assert set(path.crossings["dp_rank"]) == {dp_rank}
        timings = queries.request_timings(dp2_store, rid)
        assert timings["num_steps"] == len(served) and timings["dp_rank"] == dp_rank
    rid = requests["request_id"][requests["dp_rank"] == 1].iloc[0]
    out = io.StringIO()
    assert cli.trace_request(traced_dp2_run, rid, out=out) == 0
    assert out.getvalue().splitlines()[0].endswith("DP rank 1")


def test_single_rank_trace_prints_no_rank_table(tmp_path: Path):
    from stepscope.traces import names as n

    path = tmp_path / "one.duckdb"
    with TraceStore(path) as store:
        store.insert_spans(
            [
                {"trace_id": "a" * 32, "span_id": f"{i:016x}", "name": n.ENGINE_STEP,
                 "service_name": n.SERVICE_ENGINE_CORE, "start_ns": i * 10, "end_ns": i * 10 + 5,
                 "attributes": {n.STEP: i, n.TOKEN_BUDGET: 8, n.NUM_DECODE_TOKENS: 2}}
                for i in range(3)
            ]
        )  # fmt: skip
    out = io.StringIO()
    cli.trace_summary(str(path), out=out)
    text = out.getvalue()
    assert "work per DP rank" not in text and "dp_rank" not in text
    with TraceStore(path, read_only=True) as store:
        assert list(queries.summary(store)["ranks"]["steps"]) == [3]
