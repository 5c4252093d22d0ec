"""Contention named, not blamed on neighbours: each worker step records its process CPU time
beside its wall time, and explain names a busy machine when the steps that ran a request got far
less CPU than their threads could use.

The wording is checked on trace files written span by span with known CPU and wall times; the
recording on the session's real offline and TP=2 runs; and (slow) a real run beside busy loops
on the same cores.
"""

from __future__ import annotations

import io
import os
import sys

import pytest

from stepscope.traces import names as n
from stepscope.traces.backend import cli
from stepscope.traces.backend.explain import cause, explain
from stepscope.traces.backend.store import TraceStore
from stepscope.traces.backend.units import format_seconds

BUSY_LOOP = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    pass\n"

T0 = 1_800_000_000 * 10**9
PROMPT = 10
STEPS = 6  # one prefill step for both requests, then five decode steps


def _event(name: str, time_ns: int) -> dict:
    return {"name": name, "time_ns": time_ns, "attributes": {}}


def _spans(step_s: float, cpu_fraction: float, threads: int | None) -> list[dict]:
    """Requests a and b, run together in STEPS steps of `step_s` seconds each; each step's
    rank-0 worker step took the whole step and used `cpu_fraction` of its wall time in CPU."""
    step_ns = int(step_s * 1e9)
    end = T0 + STEPS * step_ns
    spans = []
    for i, rid in enumerate("ab"):
        events = [
            _event(n.RequestEvent.QUEUED, T0 - 1_000_000 + i),
            _event(n.RequestEvent.SCHEDULED, T0),
            _event(n.RequestEvent.FIRST_TOKEN, T0 + step_ns),
            _event(n.RequestEvent.FINISHED, end),
        ]
        attributes = {
            n.REQUEST_ID: rid,
            n.GEN_AI_USAGE_INPUT_TOKENS: PROMPT,
            n.GEN_AI_USAGE_OUTPUT_TOKENS: STEPS,
        }
        spans.append(
            {
                "trace_id": f"{i + 1:032x}",
                "span_id": f"{i + 1:016x}",
                "name": n.REQUEST,
                "start_ns": T0 - 2_000_000,
                "end_ns": end + 1_000_000,
                "attributes": attributes,
                "events": events,
                "service_name": n.SERVICE_OFFLINE,
            }  # fmt: skip
        )
    for step in range(STEPS):
        start = T0 + step * step_ns
        prefill = step == 0
        trace_id = f"{100 + step:032x}"
        spans.append(
            {
                "trace_id": trace_id,
                "span_id": f"{100 + step:016x}",
                "name": n.ENGINE_STEP,
                "start_ns": start,
                "end_ns": start + step_ns,
                "service_name": n.SERVICE_OFFLINE,
                "attributes": {
                    n.STEP: step,
                    n.REQUEST_IDS: ["a", "b"],
                    n.REQUEST_NUM_TOKENS: [PROMPT, PROMPT] if prefill else [1, 1],
                    n.NUM_PREFILL_TOKENS: 2 * PROMPT if prefill else 0,
                    n.NUM_DECODE_TOKENS: 0 if prefill else 2,
                    n.NUM_RUNNING: 2,
                    n.NUM_WAITING: 0,
                    n.TOKEN_BUDGET: 64,
                },
            }  # fmt: skip
        )
        worker = {n.STEP: step, n.RANK: 0, n.CPU_TIME_NS: int(cpu_fraction * step_ns)}
        if threads is not None:
            worker[n.NUM_THREADS] = threads
        spans.append(
            {
                "trace_id": trace_id,
                "span_id": f"{200 + step:016x}",
                "name": n.WORKER_STEP,
                "parent_span_id": f"{100 + step:016x}",
                "start_ns": start,
                "end_ns": start + step_ns,
                "service_name": n.SERVICE_OFFLINE,
                "attributes": worker,
            }  # fmt: skip
        )
    return spans


def _trace(tmp_path, step_s: float, cpu_fraction: float, threads: int | None) -> str:
    path = str(tmp_path / "known.duckdb")
    with TraceStore(path) as store:
        store.insert_spans(_spans(step_s, cpu_fraction, threads))
    return path


def test_steps_that_got_a_fifth_of_a_core_are_blamed_on_the_machine(tmp_path) -> None:
    path = _trace(tmp_path, step_s=0.1, cpu_fraction=0.2, threads=2)
    with TraceStore(path, read_only=True) as store:
        steps = store.df("SELECT cpu_s, worker_s, num_threads FROM steps ORDER BY step")
        assert list(steps["cpu_s"]) == pytest.approx([0.02] * STEPS)
        assert list(steps["num_threads"]) == [2] * STEPS
        r = explain(store, "a")
    cpu = r["cpu"]
    assert cpu["cpu_share"] == pytest.approx(0.1) and cpu["cpu_cores"] == pytest.approx(0.2)
    assert cpu["contention"] and cpu["num_threads"] == 2 and cpu["steps"] == STEPS
    assert "busy with something else" in r["summary"] and "10% of the CPU time" in r["summary"]
    assert "went to their tokens" not in r["summary"]
    assert r["shared"]["interference_s"] > 0  # the token-mix estimate is still there
    assert cause(r).startswith("machine busy")
    out = io.StringIO()
    assert cli.trace_explain(path, "a", out=out) == 0
    assert "the machine was busy with something else" in out.getvalue()


def test_a_step_on_one_of_two_threads_is_not_contention(tmp_path) -> None:
    """Nine tenths of one core in every step: under half of 2 threads' time, as the tiny
    model's small matmuls on one thread get alone, so the neighbours' tokens keep the blame."""
    path = _trace(tmp_path, step_s=0.1, cpu_fraction=0.9, threads=2)
    with TraceStore(path, read_only=True) as store:
        r = explain(store, "a")
    assert r["cpu"]["cpu_share"] == pytest.approx(0.45) and not r["cpu"]["contention"]
    assert "busy with something else" not in r["summary"]
    assert "went to their tokens" in r["summary"]
    assert cause(r).startswith("shared with 1 others")


def test_without_threads_nothing_is_judged(tmp_path) -> None:
    """A GPU worker records its CPU time but no threads: no share, no verdict."""
    path = _trace(tmp_path, step_s=0.1, cpu_fraction=0.05, threads=None)
    with TraceStore(path, read_only=True) as store:
        r = explain(store, "a")
    assert r["cpu"]["cpu_share"] is None and not r["cpu"]["contention"]
    assert "busy with something else" not in r["summary"]


def test_trace_slowest_prints_hours_of_steps_without_e_notation(tmp_path) -> None:
    path = _trace(tmp_path, step_s=6000.0, cpu_fraction=0.2, threads=2)
    out = io.StringIO()
    assert cli.trace_slowest(path, 2, out=out) == 0
    text = out.getvalue()
    assert "e+" not in text and "e-0" not in text, text
    assert format_seconds(STEPS * 6000.0 + 0.003) in text  # '36000 s'
    assert "machine busy" in text
    out = io.StringIO()
    assert cli.trace_explain(path, "b", out=out) == 0
    assert "e+" not in out.getvalue(), out.getvalue()


def _assert_plausible(store: TraceStore) -> None:
    rows = store.df(
        "SELECT rank, cpu_s, (end_ns - start_ns) / 1e9 AS wall_s, num_threads FROM worker_steps"
    )
    assert len(rows) and rows["cpu_s"].notna().all() and (rows["cpu_s"] > 0).all()
    assert (rows["num_threads"] >= 1).all()
    for _, rank in rows.groupby("rank"):
        # All of the process's threads count, so a step may exceed one thread's time a little;
        # over the run, no more than the threads' wall time allows.
        capacity = (rank["wall_s"] * rank["num_threads"]).sum()
        assert 0 < rank["cpu_s"].sum() <= capacity * 1.2, rank
    steps = store.df("SELECT cpu_s, worker_s FROM steps")
    assert steps["cpu_s"].notna().all() and (steps["worker_s"] > 0).all()


def test_an_offline_run_records_each_steps_cpu_time(traced_offline_run) -> None:
    with TraceStore(traced_offline_run, read_only=True) as store:
        _assert_plausible(store)


def test_each_tp_worker_records_its_own_cpu_time(tp2_store) -> None:
    _assert_plausible(tp2_store)
    assert set(tp2_store.df("SELECT DISTINCT rank FROM worker_steps")["rank"]) == {0, 1}


@pytest.mark.slow
def test_a_real_run_beside_busy_loops_on_its_cores_names_the_machine(tmp_path, process_tree):
    """tiny-llama offline while two busy loops per core it may use hold those cores (they
    inherit its affinity): its steps get a fraction of a core, and explain says so."""
    from stepscope.engine import LLM, SamplingParams

    db = str(tmp_path / "busy.duckdb")
    llm = LLM(model="tiny-llama", trace_db=db, num_kv_blocks=64)
    loops = [
        process_tree.popen([sys.executable, "-c", BUSY_LOOP])
        for _ in range(2 * len(os.sched_getaffinity(0)))
    ]
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(["Hello there", "A second prompt"], [params] * 2, use_tqdm=False)
    finally:
        for loop in loops:
            loop.kill()
        llm.shutdown()
    with TraceStore(db, read_only=True) as store:
        _assert_plausible(store)
        r = explain(store)
    assert r["cpu"]["contention"], r["cpu"]
    assert "busy with something else" in r["summary"], r["summary"]
