"""The engine across real processes: API (this process) -> engine core -> workers over ZMQ.

Same tokens as in-process, vLLM's process count (1 API + 1 engine core + N workers), clear errors
when a process dies, and no process left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.frontend.async_llm import AsyncLLM
from stepscope.engine.frontend.engine_group import EngineDeadError
from tests.process_tree import pid_alive, wait_pids_gone

PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TINY = {"model": "tiny-llama", "num_kv_blocks": 64, "max_num_batched_tokens": 24}


@pytest.fixture(scope="module")
def uni_tokens() -> list[list[int]]:
    llm = LLM(**TINY)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_mp_executor_gives_the_uni_tokens_with_one_process_per_rank(uni_tokens, tp: int) -> None:
    with LLM(**TINY, executor="mp", tensor_parallel_size=tp) as llm:
        procs = llm.processes()
        roles = [p.role for p in procs]
        # vLLM's A + DP + N with DP = 1: one API process, one engine core, N workers.
        assert roles.count("api") == 1 and roles.count("engine_core") == 1
        assert sorted(p.rank for p in procs if p.role == "worker") == list(range(tp))
        assert len({p.pid for p in procs}) == 2 + tp
        assert all(pid_alive(p.pid) for p in procs)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == uni_tokens
        pids = [p.pid for p in procs if p.role != "api"]
    assert wait_pids_gone(pids) == []


@pytest.mark.slow
def test_smollm2_tp3_gives_the_tp1_tokens() -> None:
    # SmolLM2 has 9 query and 3 KV heads: TP=3 puts one KV head on each worker.
    prompts = ["The history of the Roman Empire began", "Les montagnes de Suisse sont"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    tokens = {}
    for tp in (1, 3):
        with LLM(num_kv_blocks=128, executor="mp", tensor_parallel_size=tp, dtype="float32") as llm:
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens[3] == tokens[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "victim"),
    [("tp2", "engine_core"), ("tp2", "worker"), ("dp2", "engine_core"), ("dp2", "worker")],
)
def test_a_killed_process_fails_the_requests_within_seconds(layout: str, victim: str) -> None:
    """At TP=2 the one engine fails; at DP=2 killing a process of rank 1 fails the whole group,
    with an error naming the rank."""
    parallel = {"tensor_parallel_size": 2} if layout == "tp2" else {"data_parallel_size": 2}
    llm = LLM(**TINY, executor="mp", **parallel)
    procs = llm.processes()
    dp_rank = 1 if layout == "dp2" else 0
    pid = next(p.pid for p in procs if p.role == victim and p.dp_rank == dp_rank)
    killed_at: list[float] = []

    def kill_soon() -> None:
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    long = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # to the context
    with pytest.raises(EngineDeadError, match="DP rank 1" if layout == "dp2" else None):
        while True:  # busy (on every rank) until the kill
            llm.generate(["Hello"] * 4, long, use_tqdm=False)
    # Noticed within a second or two on a quiet machine. Under `make test` every process of
    # this test shares one core (xdist binds each worker to its own), beside rank 0 decoding
    # at full speed: it once took 6.7 s there, and a machine twice as slow must still pass.
    assert time.monotonic() - killed_at[0] < 15.0
    with pytest.raises(EngineDeadError):  # and every later request, at once
        llm.generate("Hello", GREEDY, use_tqdm=False)
    llm.shutdown()
    assert wait_pids_gone([p.pid for p in procs if p.role != "api"]) == []


def test_async_engine_streams_aborts_and_frees_blocks(uni_tokens) -> None:
    async def run() -> None:
        engine = AsyncLLM("tiny-llama", num_kv_blocks=64, max_num_batched_tokens=24)
        try:

            async def collect(i: int) -> list[int]:
                tokens: list[int] = []
                async for out in engine.generate(PROMPTS[i], GREEDY, f"req-{i}"):
                    tokens += out.outputs[0].token_ids
                return tokens

            got = await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))
            assert got == uni_tokens
            long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
            stream = engine.generate("abort me", long, "to-abort")
            async for _ in stream:
                break
            await stream.aclose()  # what a client disconnect does
            for _ in range(50):
                stats = await engine.get_stats()
                if stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.1)
            assert stats["num_running"] == 0 and stats["num_free_blocks"] == 64
        finally:
            engine.shutdown()

    asyncio.run(run())


@pytest.mark.slow
def test_async_engine_fails_in_flight_requests_when_the_core_dies() -> None:
    async def run() -> None:
        engine = AsyncLLM("tiny-llama", num_kv_blocks=64)
        core = next(p.pid for p in engine.processes() if p.role == "engine_core")
        long = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # to the context
        try:
            stream = engine.generate("Hello", long, "r")
            await stream.__anext__()
            os.kill(core, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert time.monotonic() - start < 5.0
            assert engine.is_dead
        finally:
            engine.shutdown()

    asyncio.run(run())


SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    # Ctrl-C must reach us as KeyboardInterrupt whatever we inherited: a shell starts a
    # background job (`make test &`) with SIGINT ignored, and Python keeps that disposition.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Likewise SIGHUP, which `nohup make test` leaves ignored, and SIGTERM: their default action.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from stepscope.engine import LLM, SamplingParams
    llm = LLM(model="tiny-llama", num_kv_blocks=32, executor="mp", tensor_parallel_size=2)
    print(" ".join(str(p.pid) for p in llm.processes() if p.role != "api"), flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)  # no shutdown(): interpreter exit must clean up
    while True:  # busy until a signal ends us
        llm.generate(["Hello"] * 2, SamplingParams(max_tokens=None, ignore_eos=True))
    """
)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "signum", "background"),
    [
        ("exit", None, False),
        ("ctrl-c", signal.SIGINT, False),
        # As under `make test &`: the script inherits SIGINT ignored, and must still stop.
        ("ctrl-c-in-background-job", signal.SIGINT, True),
        ("sigterm", signal.SIGTERM, False),
        ("sighup", signal.SIGHUP, False),
        ("sigkill", signal.SIGKILL, False),
    ],
)
def test_no_process_outlives_its_script(
    tmp_path, process_tree, how: str, signum: int | None, background: bool
) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    proc = process_tree.popen(
        [sys.executable, str(script), how],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=_ignore_sigint if background else None,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3
    if signum is not None:
        time.sleep(1.0)
        proc.send_signal(signum)
    proc.wait(timeout=30)
    assert wait_pids_gone(pids) == []
