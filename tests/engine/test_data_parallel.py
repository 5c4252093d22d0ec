"""Data parallelism: several engine cores behind a coordinator, each request on the least-loaded.

Same greedy tokens at DP=1 and DP=2 (with TP=1 and TP=2), vLLM's process count A + DP + DP x TP
+ 1 coordinator, both ranks serving a burst (read back from the trace's `dp_rank`), and a dead
rank failing every stream (a killed rank's process: tests/engine/test_engine_processes.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.frontend.async_llm import AsyncLLM
from stepscope.engine.frontend.engine_group import EngineDeadError
from stepscope.engine.frontend.load_balancer import LoadBalancer, merge_stats
from stepscope.engine.liveness import ENGINE_PROCESS_POLL_S
from tests.process_tree import noticed_within, pid_alive, wait_pids_gone

PROMPTS = [f"Request {i}: " + "word " * (3 + 5 * i) for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TINY = {"model": "tiny-llama", "num_kv_blocks": 64, "max_num_batched_tokens": 32}


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def dp1_tokens() -> list[list[int]]:
    with LLM(**TINY) as llm:
        return tokens(llm)


# ---- the balancer alone -----------------------------------------------------------------------
def test_balancer_alternates_a_burst_and_follows_published_loads() -> None:
    lb = LoadBalancer(2)
    assert [lb.choose(f"a{i}") for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert (
        lb.update([[10, 0, 0], [0, 2, 0]]) is None
    )  # rank 0 has a long queue: the next ones go to rank 1
    assert [lb.choose(f"b{i}") for i in range(3)] == [1, 1, 1]
    assert lb.by_rank(["a0", "a1", "b0", "gone"]) == {0: ["a0"], 1: ["a1", "b0"]}
    lb.finished("a0")
    assert lb.in_flight == [2, 6] and "a0" not in lb.rank_of
    assert "DP rank 1 stopped reporting" in lb.update([[0, 0, 0], [0, 0, 1]])


def test_stats_of_ranks_add_up() -> None:
    one = {"num_running": 2, "num_kv_blocks": 10, "num_free_blocks": 5, "kv_cache_usage": 0.5,
           "step_tokens_counts": [1, 2], "crossing_median_s": 0.001}  # fmt: skip
    two = {"num_running": 1, "num_kv_blocks": 10, "num_free_blocks": 10, "kv_cache_usage": 0.0,
           "step_tokens_counts": [0, 3], "crossing_median_s": 0.003}  # fmt: skip
    merged = merge_stats([one, two])
    assert merged["num_running"] == 3 and merged["num_kv_blocks"] == 20
    assert merged["kv_cache_usage"] == pytest.approx(0.25)
    assert merged["step_tokens_counts"] == [1, 5]
    assert merged["crossing_median_s"] == 0.003 and merged["ranks"] == [one, two]


# ---- real processes ---------------------------------------------------------------------------
@pytest.mark.slow
def test_dp2_gives_the_dp1_tokens_with_vllms_process_count(dp1_tokens) -> None:
    with LLM(**TINY, executor="mp", data_parallel_size=2) as llm:
        procs = llm.processes()
        roles = sorted(p.role for p in procs)
        # A + DP + N (+1 coordinator) = 1 + 2 + 2 + 1.
        assert roles == ["api", "dp_coordinator", "engine_core", "engine_core", "worker", "worker"]
        assert len({p.pid for p in procs}) == 6 and all(pid_alive(p.pid) for p in procs)
        assert sorted((p.rank, p.dp_rank) for p in procs if p.role == "engine_core") == [
            (0, 0),
            (1, 1),
        ]
        assert sorted(p.dp_rank for p in procs if p.role == "worker") == [0, 1]
        assert tokens(llm) == dp1_tokens
        stats = llm.get_stats()
        assert len(stats["ranks"]) == 2 and all(r["num_steps"] > 0 for r in stats["ranks"])
        pids = [p.pid for p in procs if p.role != "api"]
    assert wait_pids_gone(pids) == []


@pytest.mark.slow
def test_dp2_with_tp2_gives_the_dp1_tokens(dp1_tokens) -> None:
    with LLM(**TINY, executor="mp", data_parallel_size=2, tensor_parallel_size=2) as llm:
        procs = llm.processes()
        assert len({p.pid for p in procs}) == 1 + 1 + 2 + 4
        workers = sorted((p.dp_rank, p.rank) for p in procs if p.role == "worker")
        assert workers == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert tokens(llm) == dp1_tokens
        pids = [p.pid for p in procs if p.role != "api"]
    assert wait_pids_gone(pids) == []


@pytest.mark.slow
def test_a_burst_is_served_by_both_ranks_as_the_trace_shows(tmp_path) -> None:
    db = tmp_path / "dp.duckdb"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(**TINY, executor="mp", data_parallel_size=2, trace_db=db) as llm:
        llm.generate([f"Burst {i}: " + "x " * i for i in range(16)], params, use_tqdm=False)
        per_rank = llm.query_traces(
            "SELECT dp_rank, count(*) AS n, sum(output_tokens) AS tokens "
            "FROM requests GROUP BY dp_rank ORDER BY dp_rank"
        )
        steps = llm.query_traces("SELECT DISTINCT dp_rank FROM steps ORDER BY dp_rank")
        # Each rank computes its own requests' tokens and no more: prompt less prefix hits, plus
        # every output token but the last (sampled, never fed back).
        own = llm.query_traces(
            "SELECT dp_rank, sum(input_tokens - coalesce(cached_tokens, 0) + output_tokens - 1) "
            "AS own FROM requests GROUP BY dp_rank ORDER BY dp_rank"
        )
        scheduled = llm.query_traces(
            "SELECT dp_rank, sum(num_prefill_tokens + num_decode_tokens) AS tokens FROM steps "
            "GROUP BY dp_rank ORDER BY dp_rank"
        )
        workers = llm.query_traces("SELECT DISTINCT dp_rank FROM worker_steps ORDER BY dp_rank")
        crossings = llm.query_traces(
            "SELECT boundary, side, dp_rank, count(*) AS n FROM crossings GROUP BY ALL ORDER BY ALL"
        )
    assert per_rank["dp_rank"].tolist() == [0, 1]
    assert per_rank["n"].sum() == 16
    low, high = sorted(per_rank["tokens"])
    assert high <= 2 * low
    assert steps["dp_rank"].tolist() == [0, 1] and workers["dp_rank"].tolist() == [0, 1]
    assert own["own"].tolist() == scheduled["tokens"].tolist()
    # Every boundary is crossed on both ranks, on both sides (the API side names the rank).
    assert (crossings.groupby(["boundary", "side"])["dp_rank"].nunique() == 2).all()
    assert len(crossings.groupby(["boundary", "side"])) == 8


@pytest.mark.slow
def test_async_engine_fails_every_stream_when_a_rank_dies() -> None:
    async def run() -> None:
        engine = AsyncLLM("tiny-llama", num_kv_blocks=64, data_parallel_size=2, executor="uni")
        procs = engine.processes()
        core = next(p.pid for p in procs if p.role == "engine_core" and p.dp_rank == 0)
        long = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        try:
            streams = [engine.generate("Hello", long, f"r{i}") for i in range(2)]
            for stream in streams:
                await stream.__anext__()
            os.kill(core, signal.SIGKILL)
            start = time.monotonic()
            for stream in streams:
                with pytest.raises(EngineDeadError):
                    async for _ in stream:
                        pass
            # The API side polls its engine cores' processes.
            assert time.monotonic() - start < noticed_within(ENGINE_PROCESS_POLL_S)
            assert engine.is_dead and "DP rank 0" in engine.dead_reason
        finally:
            engine.shutdown()
        assert wait_pids_gone([p.pid for p in procs if p.role != "api"]) == []

    asyncio.run(run())


@pytest.mark.slow
def test_a_rank_decoding_steadily_keeps_its_heartbeat() -> None:
    # One long decode per rank: outputs every step, the (waiting, running) pair unchanged for
    # longer than the coordinator's DP_RANK_TIMEOUT_S. The heartbeat must still go out.
    from stepscope.engine.liveness import DP_RANK_TIMEOUT_S

    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    with LLM(**TINY, data_parallel_size=2) as llm:
        start = time.monotonic()
        outs = llm.generate(["Once upon a time", "In a galaxy far away"], long, use_tqdm=False)
        elapsed = time.monotonic() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [900, 900]
    if elapsed < DP_RANK_TIMEOUT_S + 1:
        pytest.skip(f"decoding took {elapsed:.1f} s, too fast to outlast the heartbeat timeout")
