"""The multi-process executor with real worker processes: same greedy tokens as the in-process
executor for tensor parallelism 1, 2 and 4 (and the same sampled ones with one worker),
identical logits on every rank, a clear error when a worker dies or fails to start, and no
process left behind."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.executor.multiproc_executor import MultiprocExecutor
from stepscope.engine.executor.uniproc_executor import UniProcExecutor
from stepscope.engine.messages import (
    CachedRequestData,
    EngineCoreRequest,
    NewRequestData,
    SchedulerOutput,
)
from stepscope.engine.models.loader import resolve_model
from stepscope.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPT_LENS = (5, 37, 90)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model("tiny-llama")


def small_config(tp: int | None = None) -> EngineConfig:
    """The in-process executor's config, or with `tp` the multiprocess executor's at that size.
    A 32-token budget chunks the 37- and 90-token prompts over several steps, mixed with
    decodes."""
    parallel = {} if tp is None else {"executor": "mp", "tensor_parallel_size": tp}
    return EngineConfig.create(
        model="tiny-llama", num_kv_blocks=64, max_num_batched_tokens=32, **parallel
    )


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(100, 40000, n).tolist() for n in PROMPT_LENS]


def add_prompts(core: EngineCore, max_tokens: int = MAX_TOKENS) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts()):
        core.add_request(EngineCoreRequest(f"req-{i}", ids, params, None, time.time()))


SAMPLED = ("sampled-engine-seed", "sampled-own-seed")


def generate(core: EngineCore) -> dict[str, list[int]]:
    """Greedy requests, plus two sampled ones (the engine's seed, or the request's own)."""
    add_prompts(core)
    prompt = prompts()[1][:20]
    for req_id, seed in zip(SAMPLED, (None, 5), strict=True):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
        core.add_request(EngineCoreRequest(req_id, prompt, params, None, time.time()))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_children() -> set[int]:
    """This process's live descendants, less multiprocessing's own resource tracker (started
    with the first spawned process, it lives as long as this process)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                "resource_tracker" in part for part in child.cmdline()
            ):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def uni_tokens(model_dir: Path) -> dict[str, list[int]]:
    core = EngineCore(small_config(), model_dir)
    return generate(core)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_greedy_tokens_match_uniproc_executor(
    model_dir: Path, uni_tokens: dict[str, list[int]], tp: int
) -> None:
    executor = MultiprocExecutor(small_config(tp), model_dir)
    try:
        assert [(role, rank) for role, rank, _ in executor.processes()] == [
            ("worker", r) for r in range(tp)
        ]
        core = EngineCore(small_config(tp), model_dir, executor=executor)
        assert core.num_kv_blocks == 64
        tokens = generate(core)
        assert all(len(t) == MAX_TOKENS for t in uni_tokens.values())
        if tp == 1:  # one worker computes what the in-process executor computes, bit for bit
            assert tokens == uni_tokens
        else:
            # Row-parallel layers add the ranks' partial sums, which round otherwise than one
            # process's sum: greedy tokens keep their margin, but a sampled draw that lands
            # within rounding of a boundary between two tokens may go the other way. So under
            # TP a sampled request with its own seed must reproduce itself: the same tokens
            # when the same requests run again, in the same steps (no prefix-cache hits).
            greedy = {r: t for r, t in tokens.items() if r not in SAMPLED}
            assert greedy == {r: t for r, t in uni_tokens.items() if r not in SAMPLED}
            assert core.reset_prefix_cache()
            again = generate(core)
            assert again["sampled-own-seed"] == tokens["sampled-own-seed"]
            assert len(tokens["sampled-engine-seed"]) == MAX_TOKENS
        # A step sent while another ran (async scheduling) has no crossing time of its own.
        if not core.async_scheduling:
            assert executor.last_crossing_seconds is not None
            assert 0 < executor.last_crossing_seconds < 1.0
    finally:
        executor.shutdown()


def rank_logits(
    rank: int, world_size: int, dist_init: str
) -> tuple[list[tuple[int, ...]], list[np.ndarray]]:
    """One tensor-parallel rank runs a prefill step then a decode step: its KV cache shapes and
    the logits of both steps."""
    import torch.distributed as dist

    from stepscope.engine.worker.worker import Worker

    all_reduce = None
    if world_size > 1:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=dist_init, rank=rank, world_size=world_size)
        all_reduce = dist.all_reduce
    worker = Worker(small_config(), resolve_model("tiny-llama"), rank, world_size, all_reduce)
    worker.init_kv_cache(8)
    runner = worker.model_runner
    captured: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(compute_logits(hidden))
        return captured[-1]

    runner.model.compute_logits = capture
    prompt = prompts()[2]
    n = len(prompt)
    new = NewRequestData("r", prompt, SamplingParams(temperature=0.0), list(range(8)), 0)
    worker.execute_model(SchedulerOutput(0, [new], CachedRequestData(), {"r": n}, n, [], []))
    cached = CachedRequestData(["r"], [[]], [n])
    worker.execute_model(SchedulerOutput(1, [], cached, {"r": 1}, 1, [], []))
    if world_size > 1:
        dist.destroy_process_group()
    return [tuple(k.shape) for k, _ in runner.kv_caches], [t.numpy() for t in captured]


def _rank_logits_child(rank: int, world_size: int, dist_init: str, queue) -> None:
    queue.put((rank, *rank_logits(rank, world_size, dist_init)))


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_rank_computes_identical_logits(tp: int) -> None:
    from stepscope.traces.process import free_port

    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    dist_init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        spawn.Process(target=_rank_logits_child, args=(r, tp, dist_init, queue), daemon=True)
        for r in range(tp)
    ]
    for p in procs:
        p.start()
    try:
        results = {
            r: (shapes, logits) for r, shapes, logits in (queue.get(timeout=90) for _ in procs)
        }
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    ref_shapes, ref_logits = rank_logits(0, 1, "")
    block_size, kv_heads, head_dim = ref_shapes[0][1:]
    for rank in range(tp):
        shapes, logits = results[rank]
        # Each rank caches only its own KV heads.
        assert all(s == (8, block_size, kv_heads // tp, head_dim) for s in shapes)
        # lm_head is replicated and hidden states are all-reduced: bit for bit the same logits.
        for got, want in zip(logits, results[0][1], strict=True):
            np.testing.assert_array_equal(got, want)
    # Against one process only the float32 summation order differs.
    for got, want in zip(results[0][1], ref_logits, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("victim", [0, 1])
def test_worker_killed_mid_run_raises_within_seconds(model_dir: Path, victim: int) -> None:
    executor = MultiprocExecutor(small_config(2), model_dir)
    pids = [pid for _, _, pid in executor.processes()]
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pids[victim], signal.SIGKILL)

    try:
        core = EngineCore(small_config(2), model_dir, executor=executor)
        add_prompts(core, max_tokens=400)
        core.step()
        # From another thread, so that the signal may land while a step is in flight.
        timer = threading.Timer(0.2, kill)
        timer.start()
        with pytest.raises(
            RuntimeError, match=rf"worker rank {victim} \(pid {pids[victim]}\) died"
        ):
            while core.has_unfinished_requests():
                core.step()
        timer.join()
        assert time.monotonic() - killed_at[0] < 5.0
        # The other rank is stopped too, and every later call fails at once.
        assert wait_gone(pids, timeout=5.0) == []
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="died"):
            executor.execute_model(SchedulerOutput(9, [], CachedRequestData(), {}, 0, [], []))
        with pytest.raises(RuntimeError, match="died"):
            executor.check_health()
        assert time.monotonic() - start < 0.5
    finally:
        executor.shutdown()
    assert wait_gone(pids, timeout=5.0) == []


def test_worker_start_failure_raises_with_worker_error(model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")  # no weights
    before = live_children()
    with pytest.raises(
        RuntimeError, match=r"(?s)worker rank [01] \(pid \d+\) failed to start.*model\.safetensors"
    ):
        MultiprocExecutor(small_config(2), tmp_path)
    assert live_children() - before == set()


def test_kv_pool_sized_as_one_process_on_a_shared_host(model_dir: Path) -> None:
    # Each CPU rank takes 1/tp of the memory budget for blocks holding 1/tp of the KV heads, so
    # the pool has as many blocks as one process would give it (memory may drift in between).
    config = EngineConfig.create(model="tiny-llama")
    uni_blocks = UniProcExecutor(config, model_dir).determine_num_kv_blocks()
    tp2 = EngineConfig.create(model="tiny-llama", executor="mp", tensor_parallel_size=2)
    executor = MultiprocExecutor(tp2, model_dir)
    try:
        per_rank = executor.collective_rpc("determine_num_kv_blocks")
        assert executor.determine_num_kv_blocks() == min(per_rank)
        assert 0.8 < min(per_rank) / uni_blocks < 1.25
    finally:
        executor.shutdown()


def test_tp_size_must_divide_heads(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        MultiprocExecutor(small_config(3), model_dir)


def test_shutdown_leaves_no_process(model_dir: Path) -> None:
    before = live_children()
    executor = MultiprocExecutor(small_config(2), model_dir)
    pids = [pid for _, _, pid in executor.processes()]
    assert all(alive(p) for p in pids)
    socket_dir = Path(executor._group.tmp_dir)
    assert socket_dir.exists()
    executor.shutdown()
    executor.shutdown()  # idempotent
    assert wait_gone(pids, timeout=5.0) == []
    assert not socket_dir.exists()
    assert live_children() - before == set()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.determine_num_kv_blocks()


PARENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from stepscope.engine.config import EngineConfig
    from stepscope.engine.models.loader import resolve_model
    from stepscope.engine.executor.multiproc_executor import MultiprocExecutor

    if __name__ == "__main__":
        config = EngineConfig.create(
            model="tiny-llama", num_kv_blocks=64, executor="mp", tensor_parallel_size=2
        )
        executor = MultiprocExecutor(config, resolve_model("tiny-llama"))
        print(executor._group.tmp_dir, flush=True)
        print(" ".join(str(pid) for _, _, pid in executor.processes()), flush=True)
        if sys.argv[1] == "wait":
            time.sleep(120)
        # "exit": once the test has seen the workers alive, leave without shutdown(); the
        # interpreter-exit hook must stop the workers
        sys.stdin.readline()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_workers_do_not_outlive_the_engine_process(tmp_path: Path, process_tree, how: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    mode = "exit" if how == "exit" else "wait"
    parent = process_tree.popen(
        [sys.executable, str(script), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    socket_dir = Path(parent.stdout.readline().strip())
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    if how == "sigkill":
        parent.kill()
    else:
        parent.stdin.write("go\n")
        parent.stdin.flush()
    parent.wait(timeout=30)
    assert wait_gone(pids, timeout=5.0) == []
    assert not socket_dir.exists()
