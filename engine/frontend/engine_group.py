"""Process launching and the start-up handshake of the engine side, run by whoever starts the
engine cores: the API server with one API server, else the launcher (`stepscope serve` with several
API servers or machines). Mirrors vLLM's vllm/v1/engine/utils.py (`CoreEngineProcManager`,
`launch_core_engines`).

- `EngineGroup`: the DP coordinator when DP > 1, an engine-core process per local DP rank, and the
  handshake that waits until every rank is ready.
- `EngineHandles`: what an API server needs to reach engine cores it did not start.
- `start_core_process`, `stop_process`: one engine-core process, started or stopped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from stepscope.engine.config import Endpoints, EngineConfig
from stepscope.engine.liveness import ENGINE_PROCESS_POLL_S
from stepscope.engine.messages import (
    CoreAddresses,
    CoreProcArgs,
    EngineCoreReady,
    EngineDead,
    OutputKind,
    ProcessInfo,
    RequestKind,
)
from stepscope.traces import names
from stepscope.traces.process import free_port
from stepscope.traces.run_spans import process_start_span, start_span
from stepscope.traces.spans import inject_context

if TYPE_CHECKING:
    from stepscope.engine.executor.ray_utils import ActorProcess

STARTUP_TIMEOUT_S = 600.0  # the first start may convert the default model (~20 s) and load it


# How an engine core starts, as the trace names it.
_BACKENDS = {"mp": "process", "ray": "ray"}


class EngineDeadError(RuntimeError):
    """The engine core (or one of its workers) died; no request can be served any more."""


# What an engine core sends to the handshake socket: ready, or dead before it got there.
_HANDSHAKE_DECODERS = {
    OutputKind.READY: msgspec.msgpack.Decoder(EngineCoreReady),
    OutputKind.DEAD: msgspec.msgpack.Decoder(EngineDead),
}


class EngineHandles(msgspec.Struct, array_like=True):
    """What an API server needs to reach every engine core that a launcher started (or that
    registered with it from another machine)."""

    input_addrs: list[str]  # per DP rank: where its engine core takes requests
    ready: list[EngineCoreReady]  # per DP rank: its handshake
    publish_addr: str | None = None  # the DP coordinator's loads (DP > 1)
    coordinator_pid: int | None = None
    local_pids: list[int] = []  # engine cores and coordinator on this machine, to watch

    @property
    def num_kv_blocks(self) -> int:
        return self.ready[0].num_kv_blocks

    @property
    def max_model_len(self) -> int:
        return self.ready[0].max_model_len

    def processes(self) -> list[ProcessInfo]:
        coordinator = (
            [ProcessInfo("dp_coordinator", 0, self.coordinator_pid)]
            if self.coordinator_pid is not None
            else []
        )
        return [*coordinator, *(p for ready in self.ready for p in ready.processes)]


class Attachment(msgspec.Struct, array_like=True):
    """How one of several API servers joins engine cores a launcher started: their handles, its
    client index (the engine cores send its requests' outputs to it alone) and the address it
    receives them at."""

    handles: EngineHandles
    client_index: int
    output_addr: str


def describe_rank(dp_size: int, rank: int, what: str) -> str:
    if dp_size == 1:
        return f"the engine core {what}"
    return f"the engine core of DP rank {rank} {what}"


def _spawn(module: str, args: msgspec.Struct) -> subprocess.Popen:
    """A fresh interpreter running `module`, its arguments on stdin. Not multiprocessing: nothing
    of this process (its __main__, threads, tracer provider) is inherited, and user scripts need
    no __main__ guard."""
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(msgspec.msgpack.encode(args))
    proc.stdin.close()
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: an engine core stops its workers on the way out
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


class EngineGroup:
    """The engine side of a deployment, as its launcher holds it (vLLM: `CoreEngineProcManager`
    with `launch_core_engines`): the DP coordinator when DP > 1, an engine-core process for each
    local DP rank, and the handshake that waits until every rank, local or registering from
    another machine, is ready, then tells each where its API servers listen.

    `output_addrs` are the API servers' output sockets, by client index (they bind them).
    `local_ranks` defaults to every rank; `handshake_bind` (a TCP address) lets engine cores on
    other machines register (`stepscope serve --headless`), and `host` is then the address this
    machine is reached at. Starting fails as a whole, and stops what did start.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        endpoints: Endpoints,
        output_addrs: list[str],
        *,
        local_ranks: range | None = None,
        handshake_bind: str | None = None,
        host: str | None = None,
        ready_timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.size = config.parallel_config.data_parallel_size
        self.backend = config.parallel_config.data_parallel_backend
        local_ranks = range(self.size) if local_ranks is None else local_ranks
        self._dir = tempfile.mkdtemp(prefix="stepscope-")
        self._ctx = zmq.Context()
        # Engine-core processes by DP rank (Ray actors, held alike, with the ray backend).
        self.procs: dict[int, subprocess.Popen | ActorProcess] = {}
        self.coordinator: subprocess.Popen | None = None
        self._coordinators: list[subprocess.Popen] = []  # the one above, for the finalizer
        self._inputs: list[zmq.Socket] = []
        self._finalizer = weakref.finalize(
            self, _stop_group, self.procs, self._coordinators, self._dir, self._ctx
        )
        # Joining the Ray cluster comes first (the API side may have done it already, to choose
        # its output address): the start's span reaches back to it.
        p = config.parallel_config
        self.ray_connect_s: float | None = None
        start_ns = None
        if "ray" in (self.backend, p.executor):
            from stepscope.engine.executor import ray_utils

            address = ray_utils.connect_for(config, endpoints.ray_address)
            endpoints = msgspec.structs.replace(endpoints, ray_address=address)
            times = ray_utils.take_connect_times()
            start_ns = times[0] if times else None
            self.ray_connect_s = (times[1] - times[0]) / 1e9 if times else 0.0
        self._span = start_span(names.ENGINE_START, start_ns=start_ns)
        if self._span is not None:
            self._span.set_attribute(names.BACKEND, _BACKENDS[self.backend])
            endpoints = msgspec.structs.replace(
                endpoints, startup_context=inject_context(trace.set_span_in_context(self._span))
            )
        try:
            self._start(config, model_dir, endpoints, output_addrs, local_ranks, handshake_bind,
                        host, ready_timeout)  # fmt: skip
        except BaseException as e:
            if self._span is not None:
                self._span.set_status(StatusCode.ERROR, f"{type(e).__name__}: {e}")
                self._span.end()
            self.stop()
            raise
        self._record_start()

    def _start(
        self,
        config: EngineConfig,
        model_dir: Path,
        endpoints: Endpoints,
        output_addrs: list[str],
        local_ranks: range,
        handshake_bind: str | None,
        host: str | None,
        ready_timeout: float,
    ) -> None:
        from stepscope.engine.core.dp_coordinator import CoordinatorArgs

        spread = False  # engine cores on other machines
        if self.backend == "ray":
            from stepscope.engine.executor import ray_utils

            host = ray_utils.node_ip()
            spread = ray_utils.spans_hosts()
            if spread:  # the handshake, as engine cores elsewhere must reach it
                handshake_bind = f"tcp://{host}:{free_port(host)}"
        else:
            spread = len(local_ranks) < self.size and host is not None
        router = self._ctx.socket(zmq.ROUTER)
        handshake_addr = handshake_bind or f"ipc://{self._dir}/handshake"
        router.bind(handshake_addr)
        coordinator_addr = head_addr = None
        self.publish_addr = None
        if self.size > 1:
            if spread and host:  # ranks on other machines too
                coordinator_addr = f"tcp://{host}:{free_port(host)}"
                head_addr = f"tcp://{host}:{free_port(host)}"
            else:
                coordinator_addr = f"ipc://{self._dir}/loads"
            self.publish_addr = f"ipc://{self._dir}/publish"
            self.coordinator = _spawn(
                "stepscope.engine.core.dp_coordinator",
                CoordinatorArgs(
                    self.size,
                    coordinator_addr,
                    self.publish_addr,
                    os.getpid(),
                    endpoints.collector,
                    config.observability_config.otlp_endpoint,
                    head_addr,
                ),
            )
            self._coordinators.append(self.coordinator)
        self.started_ns = time.time_ns()  # the engine cores asked for
        if self.backend == "ray":
            self.procs.update(
                start_core_actors(config, endpoints, model_dir, handshake_addr, self._dir)
            )
        else:
            for local, rank in enumerate(local_ranks):
                self.procs[rank] = start_core_process(
                    config,
                    endpoints,
                    model_dir,
                    rank,
                    handshake_addr,
                    f"ipc://{self._dir}/core-{rank}",
                    local,
                    len(local_ranks),
                )
        self.ready_ns: list[int | None] = [None] * self.size
        self.ready: list[EngineCoreReady | None] = [None] * self.size
        answer = msgspec.msgpack.encode(CoreAddresses(output_addrs, coordinator_addr, head_addr))
        deadline = time.monotonic() + ready_timeout
        try:
            while any(r is None for r in self.ready):
                if router.poll(int(ENGINE_PROCESS_POLL_S * 1000)):
                    identity, kind, rank_frame, payload = router.recv_multipart()
                    rank = int(rank_frame)
                    msg = _HANDSHAKE_DECODERS[kind].decode(payload)
                    if kind == OutputKind.DEAD:
                        raise EngineDeadError(describe_rank(self.size, rank, msg.reason))
                    if not 0 <= rank < self.size or self.ready[rank] is not None:
                        continue  # a stray or duplicate registration: not ours
                    self.ready[rank] = msg
                    self.ready_ns[rank] = time.time_ns()
                    router.send_multipart([identity, answer])
                self._check_started(local_ranks)
                if time.monotonic() > deadline:
                    raise EngineDeadError(self._timeout_message(local_ranks, ready_timeout,
                                                                handshake_addr))  # fmt: skip
        finally:
            router.close(linger=1000)
        self.input_addrs = [r.input_addr for r in self.ready]  # type: ignore[union-attr]
        for addr in self.input_addrs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(addr)
            self._inputs.append(sock)

    def _record_start(self) -> None:
        """The engine start's span, with a child per engine core this group started."""
        if self._span is None:
            return
        if self.ray_connect_s is not None:
            self._span.set_attribute(names.RAY_CONNECT_S, self.ray_connect_s)
        for rank, proc in self.procs.items():
            ready = self.ready[rank]
            process_start_span(
                self._span, "engine_core", rank, self.started_ns, self.ready_ns[rank] or 0,
                ready.processes[0].pid if ready and ready.processes else proc.pid,
                actor=None if isinstance(proc, subprocess.Popen) else proc, dp_rank=rank,
            )  # fmt: skip
        self._span.end()

    def _check_started(self, local_ranks: range) -> None:
        for rank, proc in self.procs.items():
            if proc.poll() is not None and self.ready[rank] is None:
                raise EngineDeadError(
                    describe_rank(
                        self.size,
                        rank,
                        f"exited during start-up (exit code {proc.poll()}); its error is "
                        "printed above",
                    )
                )
        if self.coordinator is not None and self.coordinator.poll() is not None:
            raise EngineDeadError(
                f"the DP coordinator exited during start-up (exit code {self.coordinator.poll()})"
            )

    def _timeout_message(self, local_ranks: range, timeout: float, handshake_addr: str) -> str:
        missing = [r for r, ready in enumerate(self.ready) if ready is None]
        remote = [r for r in missing if r not in local_ranks]
        if remote:
            return (
                f"no engine core of DP ranks {remote} registered at {handshake_addr} within "
                f"{timeout:.0f} s: start `stepscope serve --headless ...` on the machine(s) that "
                "hold them, with the same --data-parallel-address and --data-parallel-rpc-port"
            )
        return f"the engine cores of DP ranks {missing} did not start within {timeout:.0f} s"

    def handles(self) -> EngineHandles:
        return EngineHandles(
            input_addrs=self.input_addrs,
            ready=self.ready,  # type: ignore[arg-type]
            publish_addr=self.publish_addr,
            coordinator_pid=self.coordinator.pid if self.coordinator is not None else None,
            # Ray actors on other hosts cannot be watched by pid from here.
            local_pids=[p.pid for p in self._all_procs() if _on_this_host(p)],
        )

    def _all_procs(self) -> list[subprocess.Popen]:
        coordinator = [self.coordinator] if self.coordinator is not None else []
        return [*self.procs.values(), *coordinator]

    def watched(self) -> list[tuple[subprocess.Popen | ActorProcess, str]]:
        """Every local process (or Ray actor) with what its death means, for a watchdog."""
        out = [
            (proc, describe_rank(self.size, rank, _died(proc))) for rank, proc in self.procs.items()
        ]
        if self.coordinator is not None:
            out.append((self.coordinator, "the DP coordinator process died"))
        return out

    def dead_reason(self) -> str | None:
        """Why the group cannot serve any more (a local process exited), or None; never blocks."""
        for proc, what in self.watched():
            if proc.poll() is not None:
                death = getattr(proc, "death", None)  # a Ray actor: what Ray said
                return f"{what} (exit code {proc.poll()}{f': {death}' if death else ''})"
        return None

    def shutdown(self) -> None:
        """Ask every engine core (remote ones too) to stop, then make sure the local ones do."""
        for sock in self._inputs:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart([RequestKind.SHUTDOWN, b""], zmq.NOBLOCK)
        # Nobody routes by the coordinator's loads any more, and ranks that stop reporting
        # while they flush their spans are not lost: stop it first.
        if self.coordinator is not None:
            stop_process(self.coordinator)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.stop()

    def stop(self) -> None:
        for sock in self._inputs:
            sock.close(linger=500)
        self._inputs.clear()
        self._finalizer()


def _on_this_host(proc: subprocess.Popen | ActorProcess) -> bool:
    if isinstance(proc, subprocess.Popen):
        return True
    from stepscope.engine.executor import ray_utils

    return proc.node_ip == ray_utils.node_ip()


def _died(proc: subprocess.Popen | ActorProcess) -> str:
    if isinstance(proc, subprocess.Popen):
        return "process died"
    return f"Ray actor died (pid {proc.pid}, node {proc.node_id[:12]})"


def _stop_group(procs: dict, coordinator: list, folder: str, ctx: zmq.Context) -> None:
    for proc in [*procs.values(), *coordinator]:
        stop_process(proc)
    shutil.rmtree(folder, ignore_errors=True)
    ctx.destroy(linger=0)


def start_core_process(
    config: EngineConfig,
    endpoints: Endpoints,
    model_dir: Path,
    rank: int,
    handshake_addr: str,
    input_bind: str,
    local_index: int = 0,
    local_size: int | None = None,
) -> subprocess.Popen:
    """One engine-core process for DP rank `rank`, the `local_index`-th of `local_size` on this
    machine; it registers at `handshake_addr`."""
    return _spawn(
        "stepscope.engine.core.core_proc",
        CoreProcArgs(
            config=config.for_dp_rank(rank, local_index, local_size),
            endpoints=endpoints,
            model_dir=str(model_dir),
            handshake_addr=handshake_addr,
            input_bind=input_bind,
            parent_pid=os.getpid(),
        ),
    )


def start_core_actors(
    config: EngineConfig, endpoints: Endpoints, model_dir: Path, handshake_addr: str, folder: str
) -> dict[int, ActorProcess]:
    """`--data-parallel-backend ray`: an engine-core actor per DP rank, each in a placement group
    of its own (vLLM: `CoreEngineActorManager`), running the engine-core process's main. They
    register at `handshake_addr` like engine-core processes do.

    A rank's bundles hold the CPUs its forward passes run on: one bundle of the rank's threads
    with the uni executor (the engine core runs the forward), all TP workers' threads in one
    bundle with mp (its worker processes are its children), a bundle per TP worker with the ray
    executor (the workers are actors in the rank's group; the engine core takes no CPU of it).
    Threads per process are this machine's cores shared as the process backends share them.
    The ranks go to the cluster's nodes in turn, one per node before a second on any.
    """
    from stepscope.engine.core.core_proc import run_engine_core
    from stepscope.engine.executor import ray_utils

    p = config.parallel_config
    threads = p.cpu_threads_per_process
    if p.executor == "uni":
        bundles, resources = [{"CPU": float(threads)}], None
    elif p.executor == "mp":
        bundles, resources = [{"CPU": float(threads * p.tensor_parallel_size)}], None
    else:
        bundles, resources = [{"CPU": float(threads)}] * p.tensor_parallel_size, {}
    # Rank r goes to the r-th node that fits it, in turn (softly: anywhere if that one is full).
    nodes = ray_utils.nodes_for(sum(b["CPU"] for b in bundles)) or [None]
    actors = ray_utils.start_actors(
        [
            ray_utils.ActorSpec(
                f"stepscope-engine-core-{rank}",
                bundles,
                resources,
                node_id=nodes[rank % len(nodes)],
            )  # fmt: skip
            for rank in range(p.data_parallel_size)
        ]
    )
    here = ray_utils.node_ip()
    for rank, actor in enumerate(actors):
        # Every rank counts as one of this host's when it shares out memory, as natively.
        rank_config = config.for_dp_rank(rank, 0, p.data_parallel_size)
        rank_config = rank_config.replace(
            parallel_config=msgspec.structs.replace(
                rank_config.parallel_config, cpu_threads=threads
            )
        )
        bind = (
            f"ipc://{folder}/core-{rank}" if actor.node_ip == here else f"tcp://{actor.node_ip}:*"
        )
        actor.run(run_engine_core, rank_config, endpoints, model_dir, handshake_addr, bind, None)
    return dict(enumerate(actors))
