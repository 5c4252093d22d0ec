"""The worker process: its entry (`_worker_main`, what `start_workers` spawns) and its loop
(`WorkerProc`, as vLLM's `WorkerProc` in vllm/v1/executor/multiproc_executor.py); beside them the
headless node launcher (`run_worker_node`, the process of `stepscope serve --headless`) that
starts one machine's share of the workers.

A worker process starts with the "spawn" context (forking a process that already runs torch
threads can deadlock the child) and builds its own `Worker` after it starts; ranks of a
tensor-parallel group all-reduce over torch.distributed (gloo on CPU, NCCL on CUDA). It reports
READY, then serves the engine core's broadcast until STOP: a step through `Worker.execute_model`
(only rank 0 replies with the `ModelRunnerOutput`, since all ranks sample the same tokens), a
utility call on every rank. The frame kinds and addresses are in engine/messages.py
(`WorkerRequestKind`, `WorkerReplyKind`, `WorkerAddresses`); the engine core's side of the
sockets is engine/executor/multiproc_executor.py.

Stopping: SIGINT and SIGHUP are the engine core's to handle (ignored here); SIGTERM stops the loop
as STOP does, flushing spans; a worker exits at once when the engine-core process dies. An error
at start-up or in a step goes to the core as ERROR and ends the process (ranks are out of step).
Exits skip interpreter teardown (`os._exit`).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import shutil
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import zmq

from stepscope.engine.config import Endpoints, EngineConfig, init_engine_process_tracing
from stepscope.engine.liveness import WORKER_NODE_HEARTBEAT_S
from stepscope.engine.messages import (
    WORKER_UTILITY_METHODS,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerAddresses,
    WorkerReplyKind,
    WorkerRequestKind,
    call_utility,
)
from stepscope.traces import crossing, names
from stepscope.traces.crossing import traced_receive, traced_send
from stepscope.traces.process import free_port, ignore_terminal_signals, watch_parent
from stepscope.traces.setup import shutdown_tracing

if TYPE_CHECKING:
    from stepscope.engine.worker.worker import Worker


def describe_exit(code: int | None) -> str:
    """A worker process's exit code, in words."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def worker_addresses(config: EngineConfig, tmp_dir: str | None = None) -> WorkerAddresses:
    """ipc in `tmp_dir` with every worker on this machine; TCP at master_addr:master_port (+1,
    +2 for the sockets) when some run on other machines."""
    p = config.parallel_config
    if p.nnodes > 1:
        host, port = p.master_addr, p.master_port
        return WorkerAddresses(
            f"tcp://{host}:{port + 1}", f"tcp://{host}:{port + 2}", f"tcp://{host}:{port}"
        )
    return WorkerAddresses(
        f"ipc://{tmp_dir}/bcast", f"ipc://{tmp_dir}/results", f"tcp://127.0.0.1:{free_port()}"
    )


def start_workers(
    config: EngineConfig,
    endpoints: Endpoints,
    model_dir: Path,
    ranks: range,
    world_size: int,
    addresses: WorkerAddresses,
    socket_dir: str | None,
) -> list[BaseProcess]:
    """One spawned worker process per rank in `ranks` (this machine's) of `world_size`."""
    spawn = multiprocessing.get_context("spawn")
    config_bytes = msgspec.msgpack.encode((config, endpoints))
    procs = []
    for rank in ranks:
        proc = spawn.Process(
            target=_worker_main,
            name=f"stepscope-worker-{rank}",
            args=(
                config_bytes,
                str(model_dir),
                rank,
                world_size,
                addresses,
                socket_dir,
                os.getpid(),
            ),
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


# ---- the worker process ---------------------------------------------------------------------


class _Stopped(Exception):
    """SIGTERM reached a worker (a process manager, or the whole process group): it stops as on
    STOP, flushing its spans, instead of dying with them."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped


def _exit_when_parent_dies(parent_pid: int, socket_dir: str | None) -> None:
    """Exit even while the main thread is blocked (a recv, an all-reduce), and remove the
    socket dir the dead parent can no longer remove."""

    def exit_now() -> None:
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        os._exit(1)

    watch_parent(parent_pid, exit_now)


def _worker_main(
    config_bytes: bytes,
    model_dir: str,
    rank: int,
    world_size: int,
    addresses: WorkerAddresses,
    socket_dir: str | None,
    parent_pid: int | None,
    exit: Callable[[int], NoReturn] = os._exit,
) -> None:
    """A worker process's main (or a Ray actor's: no `parent_pid`, as Ray stops the actors of
    an engine core that is gone, and `exit` raises SystemExit, as the actor must return)."""
    ignore_terminal_signals()  # the engine core stops its workers
    signal.signal(signal.SIGTERM, _raise_stopped)
    if parent_pid is not None:
        _exit_when_parent_dies(parent_pid, socket_dir if rank == 0 else None)
    proc = WorkerProc(rank, addresses, exit)
    try:
        config, endpoints = msgspec.msgpack.decode(
            config_bytes, type=tuple[EngineConfig, Endpoints]
        )
        init_engine_process_tracing(
            names.SERVICE_WORKER, config, endpoints, rank=rank,
            dp_rank=config.parallel_config.data_parallel_rank,
        )  # fmt: skip
        worker = _build_worker(config, Path(model_dir), rank, world_size, addresses.dist_init)
    except BaseException:
        proc.exit_with_error(flush_spans=False)
    proc.run(worker)


def _build_worker(
    config: EngineConfig, model_dir: Path, rank: int, world_size: int, dist_init: str
) -> Worker:
    import torch

    from stepscope.engine.worker.worker import Worker

    m, p = config.model_config, config.parallel_config
    if m.device.startswith("cuda"):
        base = torch.device(m.device).index or 0
        local = rank % p.tensor_parallel_size_local  # its index on its own machine
        m = msgspec.structs.replace(m, device=f"cuda:{base + local}")
        config = config.replace(model_config=m)
    else:
        # Ranks share the cores: without this each would start one thread per core.
        torch.set_num_threads(p.cpu_threads_per_process)
    all_reduce = None
    if world_size > 1:
        import torch.distributed as dist

        if m.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(m.device))
            backend = "nccl"
        else:
            if p.nnodes == 1 or p.master_addr.startswith("127."):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
            backend = "gloo"
        dist.init_process_group(backend, init_method=dist_init, rank=rank, world_size=world_size)
        all_reduce = dist.all_reduce  # in-place sum over the (only) tensor-parallel group
    return Worker(config, model_dir, rank, world_size, all_reduce)


class WorkerProc:
    """One worker process's sockets and the loop that serves the engine core with its Worker."""

    def __init__(
        self, rank: int, addresses: WorkerAddresses, exit: Callable[[int], NoReturn] = os._exit
    ) -> None:
        self.rank = rank
        # How the process ends once its loop is over: os._exit skips an interpreter teardown
        # that the process group and torch's threads do not need.
        self.exit = exit
        self.ctx = zmq.Context()
        self.bcast = self.ctx.socket(zmq.SUB)
        self.bcast.setsockopt(zmq.SUBSCRIBE, b"")
        self.bcast.connect(addresses.bcast)
        self.results = self.ctx.socket(zmq.PUSH)
        self.results.setsockopt(zmq.LINGER, 5000)  # let a last error message reach the core
        self.results.connect(addresses.results)
        self.encoder = msgspec.msgpack.Encoder()
        self.step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)

    def reply(self, kind: bytes, payload: bytes, seconds: float = 0.0) -> None:
        self.results.send_multipart([kind, self.encoder.encode((self.rank, seconds)), payload])

    def run(self, worker: Worker) -> NoReturn:
        """Report ready, serve steps and calls until STOP (or SIGTERM), then flush and exit."""
        self.reply(WorkerReplyKind.READY, self.encoder.encode(os.getpid()))
        with contextlib.suppress(_Stopped):
            while (message := self.bcast.recv_multipart())[0] != WorkerRequestKind.STOP:
                self.serve_one(worker, message)
        self.ctx.destroy(linger=1000)
        shutdown_tracing()
        self.exit(0)

    def serve_one(self, worker: Worker, message: list[bytes]) -> None:
        """Run one step or utility call; on an error, report it and end the process."""
        try:
            kind, payload = message
            if kind == WorkerRequestKind.STEP:
                self.execute_model(worker, payload)
            elif kind == WorkerRequestKind.CALL:
                method, args = msgspec.msgpack.decode(payload)
                result = call_utility(worker, WORKER_UTILITY_METHODS, method, args)
                self.reply(WorkerReplyKind.RESULT, self.encoder.encode(result))
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except _Stopped:
            raise
        except BaseException:
            # Ranks are out of step now (a peer may be waiting in an all-reduce): report and exit.
            self.exit_with_error(flush_spans=True)

    def execute_model(self, worker: Worker, payload: bytes) -> None:
        """One step: receive the SchedulerOutput, run it; rank 0 sends the output back inside
        the step's span, with the seconds spent running it."""
        scheduler_output = traced_receive(
            crossing.ENGINE_CORE_TO_WORKER, self.step_decoder.decode, payload
        )
        start = time.perf_counter()

        def send_output(output: ModelRunnerOutput) -> None:
            seconds = time.perf_counter() - start
            traced_send(
                crossing.WORKER_TO_ENGINE_CORE,
                self.encoder.encode,
                output,
                step=scheduler_output.step,
                send=functools.partial(self.reply, WorkerReplyKind.OUTPUT, seconds=seconds),
            )

        worker.execute_model(scheduler_output, send_output if self.rank == 0 else None)

    def exit_with_error(self, flush_spans: bool) -> NoReturn:
        """Send the exception being handled to the core as ERROR and end the process."""
        self.reply(WorkerReplyKind.ERROR, traceback.format_exc().encode())
        self.ctx.destroy(linger=5000)
        if flush_spans:
            shutdown_tracing()
        self.exit(1)


# ---- a worker machine -----------------------------------------------------------------------


def run_worker_node(config: EngineConfig, model_dir: Path) -> int:
    """`stepscope serve --headless --nnodes N --node-rank R ...`: this machine's share of the
    TP workers of an engine core on node 0. They connect to its sockets; this process sends the
    node's heartbeat there, reports a worker that dies, and returns (0) once every worker has
    stopped (the core broadcast STOP), or 1 after a failure or a signal."""
    p = config.parallel_config
    local = p.tensor_parallel_size_local
    ranks = range(p.node_rank * local, (p.node_rank + 1) * local)
    addresses = worker_addresses(config)
    stopping: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: stopping.append(signum))
    # Spans go to --otlp-endpoint only: a headless machine has no collector.
    procs = start_workers(
        config, Endpoints(), model_dir, ranks, p.tensor_parallel_size, addresses, None
    )
    ctx = zmq.Context()
    beat = ctx.socket(zmq.PUSH)
    beat.setsockopt(zmq.LINGER, 2000)
    beat.connect(addresses.results)
    header = msgspec.msgpack.encode((p.node_rank, 0.0))
    print(
        f"stepscope: headless: TP workers {list(ranks)} of node {p.node_rank} (pids "
        f"{[p.pid for p in procs]}) joining {addresses.bcast}",
        flush=True,
    )
    code = 0
    try:
        while not stopping:
            with contextlib.suppress(zmq.Again):
                beat.send_multipart([WorkerReplyKind.HEARTBEAT, header, b""], zmq.NOBLOCK)
            ended = [(r, p) for r, p in zip(ranks, procs, strict=True) if p.exitcode is not None]
            if ended and len(ended) == len(procs) and all(p.exitcode == 0 for _, p in ended):
                break  # the engine core stopped them
            failed = [(r, p) for r, p in ended if p.exitcode != 0]
            if failed:
                rank, p = failed[0]
                text = f"worker rank {rank} (pid {p.pid}) died ({describe_exit(p.exitcode)})"
                error_header = msgspec.msgpack.encode((rank, 0.0))
                beat.send_multipart([WorkerReplyKind.ERROR, error_header, text.encode()])
                code = 1
                break
            time.sleep(WORKER_NODE_HEARTBEAT_S)
        else:
            code = 1
    finally:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(5.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)
        ctx.destroy(linger=2000)
    return code
