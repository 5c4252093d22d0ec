"""`stepscope trace whatif`: the real scheduler over a recorded run's arrivals, each step timed by
a cost model fitted on the run's own steps.

On the session's offline run: given the recorded step times the event loop gives back every
request's recorded times (so what differs in a prediction is the cost model's doing), the
self-check with the fitted model, the grid's rows and the CLI's JSON. On a hand-made bursty chat
workload (no model run): what a pool, a budget or prefix caching change, and the same answers
from worker processes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import psutil
import pytest

from stepscope.engine.entrypoints.cli.main import main
from stepscope.traces import names as n
from stepscope.traces.backend.compare import METRICS, recorded_requests, recorded_table
from stepscope.traces.backend.store import TraceStore
from stepscope.traces.backend.workload import load_workload, synthetic_prompts
from stepscope.viz import whatif as w
from stepscope.viz import whatif_report
from stepscope.viz.cost_model import (
    CostModel,
    fit_cost_model,
    fit_steps,
    nonnegative_least_squares,
    step_time_ratio,
)
from tests.traces.test_workload import appended_again
from tests.viz.whatif_workload import COST, bursty_chat

ROW_KEYS = {"settings", *METRICS}


# ---- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    ["dtype=bfloat16", "tensor_parallel_size=2", "model=smollm2-135m", "async_scheduling=on"],
)
def test_a_setting_that_changes_step_cost_is_refused_with_why(spec: str) -> None:
    with pytest.raises(ValueError, match="a trace taken under the .* you want is needed"):
        w.parse_grid([spec])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("max_num_seq=4,8", "did you mean 'max_num_seqs'"),
        ("seed=1,2", "changes neither what the scheduler decides nor what a step costs"),
        ("kv_cache_memory_fraction=0.5", "with num_kv_blocks instead"),
        ("max_num_seqs=8,lots", "max_num_seqs takes whole numbers, got 'lots'"),
        ("enable_prefix_caching=maybe", "enable_prefix_caching takes true or false"),
        ("max_num_seqs", "--grid takes KEY=V1,V2"),
    ],
)
def test_bad_grid_entries_are_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        w.parse_grid([spec])


def test_grid_values_take_their_field_type_and_slo_its_seconds() -> None:
    grid = w.parse_grid(["enable-prefix-caching=on,false", "max_num_batched_tokens=256, 512"])
    assert grid == {"enable_prefix_caching": [True, False], "max_num_batched_tokens": [256, 512]}
    assert [list(s.values()) for s in w.grid_settings(grid)] == [
        [True, 256], [True, 512], [False, 256], [False, 512]
    ]  # fmt: skip
    assert w.parse_slo(["ttft_p90=2.5", "e2e_p50_s=10"]) == {"ttft_p90": 2.5, "e2e_p50": 10.0}
    with pytest.raises(ValueError, match="--slo takes one of"):
        w.parse_slo(["throughput=5"])


def test_nonnegative_least_squares_recovers_a_step_model_and_keeps_terms_at_zero() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.integers(0, 512, 200), rng.integers(0, 64, 200)])
    y = x @ np.array([0.02, 0.0004, 0.001])
    assert nonnegative_least_squares(x, y) == pytest.approx([0.02, 0.0004, 0.001])
    # A term whose best unconstrained coefficient is negative is left out, not made negative.
    coef = nonnegative_least_squares(x, 0.05 - 0.0001 * x[:, 1])
    assert coef[1] == 0.0 and (coef >= 0).all()


# ---- a recorded run ----------------------------------------------------------------------------
class RecordedClock:
    """Stands in for the cost model: each simulated step takes the time from the recorded
    step's start to the next one's (the last: its duration), in order."""

    gap_s = 0.0

    def __init__(self, store: TraceStore) -> None:
        steps = store.df("SELECT start_ns, end_ns FROM steps ORDER BY start_ns")
        first = int(store.df("SELECT min(start_ns) AS t FROM requests")["t"][0])
        self.starts = (steps["start_ns"] - first).tolist() + [None]
        self.ends = (steps["end_ns"] - first).tolist()
        self.wake_s = fit_cost_model(store).wake_s
        self.index = 0

    def step_s(self, prefill: int, decode: int, context: int) -> float:
        k, self.index = self.index, self.index + 1
        stop = self.starts[k + 1] if self.starts[k + 1] is not None else self.ends[k]
        return (stop - self.starts[k]) / 1e9


# ---- contention --------------------------------------------------------------------------------
STEP_MODEL = (0.02, 0.0004, 0.001, 0.00001)  # fixed, per prefill, decode and context token
NO_REQUESTS = pd.DataFrame({"dp_rank": [], "queued_ns": [], "finished_ns": []})


def contended_steps(num_contended: int, n: int = 40, cpu: bool = True) -> pd.DataFrame:
    """`n` steps timed exactly by STEP_MODEL, their worker on 80% of its 2 threads, except
    `num_contended` of them, which took 5x as long on 10% (0.2 of a core); `cpu`: False, none
    recorded its CPU time (an older trace)."""
    rng = np.random.default_rng(3)
    prefill, decode = rng.integers(0, 200, n), rng.integers(1, 16, n)
    context = rng.integers(16, 2000, n)
    own = np.column_stack([np.ones(n), prefill, decode, context]) @ np.array(STEP_MODEL)
    slow = np.isin(np.arange(n), rng.choice(n, num_contended, replace=False))
    own[slow] *= 5
    start = np.concatenate([[0], np.cumsum(own[:-1] + 0.002)])
    steps = pd.DataFrame({
        "dp_rank": 0, "start_ns": (start * 1e9).astype(np.int64),
        "end_ns": ((start + own) * 1e9).astype(np.int64), "own_s": own, "prefill": prefill,
        "decode": decode, "context": context.astype(float),
        "cpu_s": np.where(slow, 0.2, 1.6) * own if cpu else np.nan, "worker_s": own,
        "num_threads": 2 if cpu else np.nan,
    })  # fmt: skip
    return steps


def test_contended_steps_at_five_times_are_left_out_and_the_fit_comes_out_right() -> None:
    model = fit_steps(contended_steps(6), NO_REQUESTS)
    assert (model.contended_steps, model.steps_left_out, model.num_steps) == (6, 6, 34)
    assert not model.busy_machine
    fitted = (model.fixed_s, model.prefill_token_s, model.decode_token_s, model.context_token_s)
    assert fitted == pytest.approx(STEP_MODEL, rel=1e-6)
    assert model.mean_abs_error_s == pytest.approx(0, abs=1e-12)
    assert model.contended_cpu_share == pytest.approx(0.1)
    assert model.contended_cpu_cores == pytest.approx(0.2)
    lines = whatif_report.model_lines(model)
    assert "6 of 40 steps left out of the fit" in lines[-1]
    assert "10% of its threads' CPU, 0.20 of a core" in lines[-1] and "e-" not in lines[-1]
    # The same steps without their CPU time (an older trace): all fitted, the fit thrown off.
    old = fit_steps(contended_steps(6, cpu=False), NO_REQUESTS)
    assert (old.contended_steps, old.num_steps) == (0, 40)
    assert old.mean_abs_error_s > 0.01 and whatif_report.contention_lines(old) == []


def regime_steps(num_small: int) -> pd.DataFrame:
    """40 steps of more than 4 tokens on STEP_MODEL and `num_small` decodes of 1-4 tokens on
    quantized kernels: 11 ms + 5 ms a token, dearer per token than the large steps' 1 ms."""
    steps = contended_steps(0)
    rng = np.random.default_rng(5)
    decode = rng.integers(1, 5, num_small)
    context = rng.integers(16, 2000, num_small).astype(float)
    small = pd.DataFrame({
        "dp_rank": 0, "start_ns": 0, "end_ns": 0, "own_s": 0.011 + 0.005 * decode,
        "prefill": 0, "decode": decode, "context": context, "cpu_s": np.nan,
        "worker_s": np.nan, "num_threads": np.nan,
    })  # fmt: skip
    steps["decode"] += 4  # every large step runs more than 4 tokens
    steps["own_s"] += 4 * STEP_MODEL[2]
    return pd.concat([steps, small], ignore_index=True)


def test_a_quantized_runs_few_token_steps_are_fitted_apart_from_the_rest() -> None:
    steps = regime_steps(12)
    model = fit_steps(steps, NO_REQUESTS, small_max_tokens=4)
    assert (model.small_max_tokens, model.small_steps) == (4, 12)
    assert model.small_terms == pytest.approx((0.011, 0.0, 0.005, 0.0), abs=1e-9)
    fitted = (model.fixed_s, model.prefill_token_s, model.decode_token_s, model.context_token_s)
    assert fitted == pytest.approx(STEP_MODEL, rel=1e-6)
    assert model.mean_abs_error_s == pytest.approx(0, abs=1e-12)
    assert model.step_s(0, 3, 500) == pytest.approx(0.026)
    assert model.step_s(0, 5, 500) == pytest.approx(0.02 + 0.005 + 0.005)
    assert "steps of up to 4 tokens" in whatif_report.model_lines(model)[0]
    # One line through both kinds misses; too few small steps to fit: one kind, said so.
    assert fit_steps(steps, NO_REQUESTS).mean_abs_error_s > 0.001
    few = fit_steps(regime_steps(7), NO_REQUESTS, small_max_tokens=4)
    assert (few.small_max_tokens, few.small_steps) == (0, 0)
    assert "steps of up to" not in whatif_report.model_lines(few)[0]


def test_a_trace_mostly_contended_is_fitted_whole_and_called_a_busy_machine() -> None:
    model = fit_steps(contended_steps(30), NO_REQUESTS)
    assert model.busy_machine and model.contended_steps == 30
    assert (model.steps_left_out, model.num_steps) == (0, 40)
    (line,) = whatif_report.contention_lines(model)
    assert line.startswith("the trace was taken on a busy machine: in 30 of 40 steps")
    assert "every prediction inherits" in line


def starve_steps(store: TraceStore, steps: tuple[int, ...]) -> None:
    """Record the worker steps of `steps` as given 1 ns of CPU time (contended, whatever they
    took) and every other worker step one full core (never contended), whatever the machine
    that recorded the trace gave them."""
    listed = ", ".join(map(str, steps))
    store.con.execute(
        f"""UPDATE spans SET attributes = json_merge_patch(attributes, json_object(
                '{n.CPU_TIME_NS}', CASE WHEN CAST(json_extract(attributes, '$."{n.STEP}"')
                                        AS INTEGER) IN ({listed}) THEN 1 ELSE duration_ns END))
        WHERE name = '{n.WORKER_STEP}'"""
    )


def test_cli_names_the_steps_it_left_out_and_json_keeps_them_on_stderr(
    traced_offline_run, tmp_path, capsys
):
    path = str(tmp_path / "starved.duckdb")
    shutil.copy(traced_offline_run, path)
    store = TraceStore(path)
    starve_steps(store, (1, 2))
    assert fit_cost_model(store).contended_steps == 2
    store.close()
    main(["trace", "whatif", path, "--grid", "max_num_seqs=2"])
    assert "2 of 10 steps left out of the fit" in capsys.readouterr().out
    main(["trace", "whatif", path, "--grid", "max_num_seqs=2", "--json"])
    captured = capsys.readouterr()
    assert [r["settings"] for r in json.loads(captured.out)] == [{"max_num_seqs": 2}]
    assert captured.err.startswith("self-check") and "2 of 10 steps left out" in captured.err


@pytest.fixture(scope="module")
def offline_store(traced_offline_run):
    store = TraceStore(traced_offline_run, read_only=True)
    yield store
    store.close()


def test_given_the_recorded_step_times_the_loop_gives_back_the_recorded_run(offline_store):
    workload = load_workload(offline_store)
    pool = int(offline_store.df("SELECT max(kv_total_blocks) AS n FROM steps")["n"][0])
    settings = w.resolve(w.recorded_flat(workload), {}, pool)
    clock = RecordedClock(offline_store)
    predicted = w.simulate(workload, synthetic_prompts(workload, 1000), settings, clock)
    assert predicted.num_steps == len(clock.ends)  # the same steps, one for one
    recorded = {r.request_id: r for r in recorded_requests(offline_store)}
    for p in predicted.requests:
        r = recorded[p.request_id]
        assert p.output_tokens == r.output_tokens and p.preemptions == r.preemptions
        assert p.ttft_s == pytest.approx(r.ttft_s, abs=0.005)
        assert p.e2e_s == pytest.approx(r.e2e_s, abs=0.005)
        assert set(p.queue_s_by_reason) <= set(r.queue_s_by_reason) | {"arrived_during_step"}
        assert sum(p.queue_s_by_reason.values()) == pytest.approx(
            sum(r.queue_s_by_reason.values()), abs=0.005
        )


def test_self_check_and_grid_on_a_recorded_run(offline_store):
    grid = w.parse_grid(["max_num_batched_tokens=16,32", "enable_chunked_prefill=true,false"])
    with pytest.raises(ValueError, match="without chunked prefill every prompt must fit"):
        w.whatif(offline_store, grid, {})
    grid = w.parse_grid(["max_num_batched_tokens=16,32,64", "max_num_seqs=1,4"])
    result = w.whatif(offline_store, grid, {"ttft_p90": 1e6})
    assert result.recorded == recorded_table(offline_store)
    # The recorded settings: the steps' total time is the fitted one, so the run's throughput
    # and last finish come back; the recorded budget's row is the self-check's prediction.
    check, recorded = result.self_check, result.recorded
    if result.model.steps_left_out:
        # Steps the contention rule named (the suite's other worker, or another job, took the
        # cores while the fixture recorded) are left out of the fit and stay in the recorded
        # times: the prediction is then faster than the recording by their extra time, never
        # slower.
        assert check["throughput_tok_s"] >= 0.8 * recorded["throughput_tok_s"]
    else:
        assert check["throughput_tok_s"] == pytest.approx(recorded["throughput_tok_s"], rel=0.2)
        assert check["e2e_p90_s"] == pytest.approx(recorded["e2e_p90_s"], rel=0.3)
    assert check["preemptions"] == recorded["preemptions"]
    assert [r["settings"] for r in result.rows] == w.grid_settings(grid)
    assert all(set(r) == ROW_KEYS for r in result.rows)
    assert result.rows[3] | {"settings": None} == check | {"settings": None}  # 32 tokens, 4 seqs
    one_at_a_time = result.rows[0]["queue_s_by_reason"]
    assert one_at_a_time.get("max_num_seqs", 0) > 0
    assert result.best is not None
    line = whatif_report.self_check_line(result)
    assert line.startswith("self-check") and "ttft_p90" in line and "throughput" in line
    text = "\n".join(whatif_report.report(result))
    assert "cost model, fitted on" in text and "fit error" in text and "<- best" in text
    assert whatif_report.CANNOT_PREDICT in text and "e+" not in text


def test_cli_json_prints_only_the_list_and_the_self_check_on_stderr(traced_offline_run, capsys):
    main(["trace", "whatif", traced_offline_run, "--grid", "max_num_seqs=2,4", "--json"])
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [r["settings"] for r in rows] == [{"max_num_seqs": 2}, {"max_num_seqs": 4}]
    assert all(set(r) == ROW_KEYS for r in rows)
    assert captured.err.startswith("self-check")
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "whatif", traced_offline_run, "--grid", "dtype=float16"])
    assert exit_info.value.code == 2
    assert "a trace taken under the dtype you want is needed" in capsys.readouterr().err


def test_a_trace_holding_two_runs_is_refused_before_any_prediction(
    traced_offline_run, tmp_path, capsys
):
    path = appended_again(traced_offline_run, tmp_path / "two.duckdb")
    store = TraceStore(path, read_only=True)
    try:
        for read in (
            fit_cost_model,
            w.load_trace,
            lambda s: w.whatif(s, {"max_num_seqs": [2]}, {}),
        ):
            with pytest.raises(ValueError, match="holds 2 runs, started at .*its own file"):
                read(store)
    finally:
        store.close()
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "whatif", path, "--grid", "max_num_seqs=2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{path} holds 2 runs" in err and "record each run to its own file" in err


# ---- a hand-made workload ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def chats():
    workload = bursty_chat(80, seed=1)
    return workload, synthetic_prompts(workload, 1 << 15), w.recorded_flat(workload)


def test_settings_change_what_the_scheduler_does(chats):
    workload, prompts, flat = chats
    runs = {
        name: w.simulate(workload, prompts, w.resolve(flat, changes, 2048), COST)
        for name, changes in {
            "recorded": {},
            "small pool": {"num_kv_blocks": 160},
            "no prefix cache": {"enable_prefix_caching": False},
            "few seqs": {"max_num_seqs": 4},
        }.items()
    }
    recorded = runs["recorded"].table
    assert runs["small pool"].table["preemptions"] > recorded["preemptions"]
    assert "kv_blocks" in runs["small pool"].table["queue_s_by_reason"]
    # Every chat long enough shares the system prompt's four blocks: without the cache, each
    # prefills them again.
    shared = 64 * sum(1 for r in workload.requests if r.input_tokens > 64)
    assert runs["no prefix cache"].prefill_tokens - runs["recorded"].prefill_tokens >= shared - 64
    assert runs["few seqs"].table["ttft_p90_s"] > recorded["ttft_p90_s"]
    assert runs["few seqs"].table["queue_s_by_reason"]["max_num_seqs"] > 0
    for run in runs.values():  # every request finished with its recorded output length
        assert sum(r.output_tokens for r in run.requests) == sum(
            r.output_tokens for r in workload.requests
        )


def test_a_prompt_longer_than_the_pool_is_refused(chats):
    workload, prompts, flat = chats
    settings = w.resolve(flat, {"num_kv_blocks": 8}, 2048)  # 128 tokens
    with pytest.raises(ValueError, match="does not fit the context of 128 tokens"):
        w.simulate(workload, prompts, settings, COST)


def test_worker_processes_predict_the_same_and_are_gone_after(chats, monkeypatch, process_tree):
    workload, prompts, flat = chats
    settings = [w.resolve(flat, {"max_num_seqs": n}, 2048) for n in (8, 16, 8, 32)]
    alone = w.predict(workload, prompts, settings, COST)
    monkeypatch.setattr(w, "PARALLEL_TOKENS", 0)
    monkeypatch.setattr(w.os, "sched_getaffinity", lambda pid: {0, 1})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with process_tree.adopting():
        spread = w.predict(workload, prompts, settings, COST)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert [p.table for p in spread] == [p.table for p in alone]
    assert spread[0].table == spread[2].table


def test_recorded_block_size_change_keeps_the_pool_memory(chats):
    _, _, flat = chats
    settings = w.resolve(flat, {"block_size": 32}, 2048)
    assert (settings.block_size, settings.num_kv_blocks) == (32, 2048)  # recorded explicitly
    moved = w.resolve({**flat, "num_kv_blocks": None}, {"block_size": 32}, 2048)
    assert moved.num_kv_blocks == 1024


class _Steps:
    """A source whose only query is the cost model's steps."""

    def __init__(self, steps: pd.DataFrame) -> None:
        self.steps = steps

    def df(self, sql: str) -> pd.DataFrame:
        return self.steps


def test_step_time_ratio_is_a_runs_step_time_over_the_models_for_the_same_steps():
    model = CostModel(0.010, 0.001, 0.002, 0.0001, small_max_tokens=4,
                      small_terms=(0.004, 0.0, 0.003, 0.0))  # fmt: skip
    steps = pd.DataFrame({"prefill": [100, 0, 0], "decode": [2, 3, 20], "context": [100, 50, None]})
    modelled = [0.010 + 0.1 + 0.004 + 0.01, 0.004 + 0.009, 0.010 + 0.04]  # the small step apart
    assert step_time_ratio(model, _Steps(steps.assign(own_s=modelled))) == pytest.approx(1.0)
    slower = steps.assign(own_s=[1.25 * t for t in modelled])
    assert step_time_ratio(model, _Steps(slower)) == pytest.approx(1.25)
    assert step_time_ratio(model, _Steps(steps.assign(own_s=modelled).iloc[:0])) is None
