"""Clients of the engine core, as the API process sees it (the API -> engine core boundary).

- `InprocClient`: the engine core in this process, stepped directly (offline default, no ZMQ).
- `SyncMPClient`: engine cores in their own processes over ZMQ, with blocking calls (`LLM`).
- `AsyncMPClient`: the same processes over asyncio ZMQ sockets (`AsyncLLM`, the server).
With data parallelism (DP > 1) there is one engine-core process per rank and a coordinator
process; the MP clients send each request to the least-loaded rank (`LoadBalancer`), aborts to
the rank that holds it, utility calls to every rank.
Requests go out as EngineCoreRequest; EngineCoreOutputs (token ids, never text) come back.
A dead engine core turns every waiting call into EngineDeadError within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.dp_coordinator import RANK_TIMEOUT_S, decode_loads
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.messages import (
    CoreAddresses,
    CoreProcArgs,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineDead,
    OutputKind,
    ProcessInfo,
    RequestKind,
    UtilityRequest,
    UtilityResult,
)
from stepscope.traces import crossing
from stepscope.traces.crossing import traced_receive, traced_send
from stepscope.traces.process import free_port

STARTUP_TIMEOUT_S = 600.0  # the first start may convert the default model (~20 s) and load it
POLL_MS = 100


class EngineDeadError(RuntimeError):
    """The engine core (or one of its workers) died; no request can be served any more."""


class InprocClient:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.core = EngineCore(config, model_dir)
        self.num_kv_blocks = self.core.num_kv_blocks
        self.max_model_len = self.core.max_model_len

    def add_request(self, request: EngineCoreRequest) -> int:
        self.core.add_request(request)
        return 0  # the only DP rank

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.core.step()
        if not self.core.last_step_ran and self.core.has_unfinished_requests():
            # In one process nothing else can free a block or a slot: waiting would be forever.
            raise RuntimeError(
                "the engine core cannot schedule any of its unfinished requests "
                f"({self.core.scheduler.num_unfinished}); this is a bug in stepscope"
            )
        return outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.core, method)(*args)

    def processes(self) -> list[ProcessInfo]:
        return self.core.processes()

    def shutdown(self) -> None:
        self.core.shutdown()


_DECODERS = {
    OutputKind.OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
    OutputKind.UTILITY: msgspec.msgpack.Decoder(UtilityResult),
    OutputKind.READY: msgspec.msgpack.Decoder(EngineCoreReady),
    OutputKind.DEAD: msgspec.msgpack.Decoder(EngineDead),
}
_REQUEST_ENCODER = msgspec.msgpack.Encoder()


def encode_request(request: EngineCoreRequest, dp_rank: int | None = None) -> bytes:
    """An EngineCoreRequest as bytes, sent under the current span (the request's)."""
    return traced_send(
        crossing.API_TO_ENGINE_CORE, _REQUEST_ENCODER.encode, request, dp_rank=dp_rank
    )


def decode_output(kind: bytes, payload: bytes, dp_rank: int | None = None) -> Any:
    """A message from an engine core; EngineCoreOutputs with their receive span."""
    if kind == OutputKind.OUTPUTS:
        return traced_receive(
            crossing.ENGINE_CORE_TO_API, _DECODERS[kind].decode, payload, dp_rank=dp_rank
        )
    return _DECODERS[kind].decode(payload)


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
        output_addrs: list[str],
        *,
        local_ranks: range | None = None,
        handshake_bind: str | None = None,
        host: str | None = None,
        ready_timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.size = config.data_parallel_size
        local_ranks = range(self.size) if local_ranks is None else local_ranks
        self._dir = tempfile.mkdtemp(prefix="stepscope-")
        self._ctx = zmq.Context()
        self.procs: dict[int, subprocess.Popen] = {}
        self.coordinator: subprocess.Popen | None = None
        self._coordinators: list[subprocess.Popen] = []  # the one above, for the finalizer
        self._inputs: list[zmq.Socket] = []
        self._finalizer = weakref.finalize(
            self, _stop_group, self.procs, self._coordinators, self._dir, self._ctx
        )
        try:
            self._start(config, model_dir, output_addrs, local_ranks, handshake_bind, host,
                        ready_timeout)  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def _start(
        self,
        config: EngineConfig,
        model_dir: Path,
        output_addrs: list[str],
        local_ranks: range,
        handshake_bind: str | None,
        host: str | None,
        ready_timeout: float,
    ) -> None:
        from stepscope.engine.core.dp_coordinator import CoordinatorArgs

        router = self._ctx.socket(zmq.ROUTER)
        handshake_addr = handshake_bind or f"ipc://{self._dir}/handshake"
        router.bind(handshake_addr)
        coordinator_addr = head_addr = None
        self.publish_addr = None
        if self.size > 1:
            if len(local_ranks) < self.size and host:  # ranks on other machines too
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
                    config.collector_endpoint,
                    config.otlp_endpoint,
                    head_addr,
                ),
            )
            self._coordinators.append(self.coordinator)
        for local, rank in enumerate(local_ranks):
            self.procs[rank] = start_core_process(
                config,
                model_dir,
                rank,
                handshake_addr,
                f"ipc://{self._dir}/core-{rank}",
                local,
                len(local_ranks),
            )
        self.ready: list[EngineCoreReady | None] = [None] * self.size
        answer = msgspec.msgpack.encode(CoreAddresses(output_addrs, coordinator_addr, head_addr))
        deadline = time.monotonic() + ready_timeout
        try:
            while any(r is None for r in self.ready):
                if router.poll(POLL_MS):
                    identity, kind, rank_frame, payload = router.recv_multipart()
                    rank = int(rank_frame)
                    msg = _DECODERS[kind].decode(payload)
                    if kind == OutputKind.DEAD:
                        raise EngineDeadError(describe_rank(self.size, rank, msg.reason))
                    if not 0 <= rank < self.size or self.ready[rank] is not None:
                        continue  # a stray or duplicate registration: not ours
                    self.ready[rank] = msg
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
            local_pids=[p.pid for p in self._all_procs()],
        )

    def _all_procs(self) -> list[subprocess.Popen]:
        coordinator = [self.coordinator] if self.coordinator is not None else []
        return [*self.procs.values(), *coordinator]

    def watched(self) -> list[tuple[subprocess.Popen, str]]:
        """Every local process with what its death means, for a watchdog."""
        out = [
            (proc, describe_rank(self.size, rank, "process died"))
            for rank, proc in self.procs.items()
        ]
        if self.coordinator is not None:
            out.append((self.coordinator, "the DP coordinator process died"))
        return out

    def dead_reason(self) -> str | None:
        """Why the group cannot serve any more (a local process exited), or None; never blocks."""
        for proc, what in self.watched():
            if proc.poll() is not None:
                return f"{what} (exit code {proc.poll()})"
        return None

    def shutdown(self) -> None:
        """Ask every engine core (remote ones too) to stop, then make sure the local ones do."""
        for sock in self._inputs:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart([RequestKind.SHUTDOWN, b""], zmq.NOBLOCK)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.stop()

    def stop(self) -> None:
        for sock in self._inputs:
            sock.close(linger=500)
        self._inputs.clear()
        self._finalizer()


def _stop_group(procs: dict, coordinator: list, folder: str, ctx: zmq.Context) -> None:
    for proc in [*procs.values(), *coordinator]:
        stop_process(proc)
    shutil.rmtree(folder, ignore_errors=True)
    ctx.destroy(linger=0)


def start_core_process(
    config: EngineConfig,
    model_dir: Path,
    rank: int,
    handshake_addr: str,
    input_bind: str,
    local_index: int = 0,
    local_size: int | None = None,
) -> subprocess.Popen:
    """One engine-core process for DP rank `rank`, the `local_index`-th of `local_size` on this
    machine; it registers at `handshake_addr`."""
    rank_config = dataclasses.replace(
        config,
        data_parallel_rank=rank,
        data_parallel_rank_local=local_index,
        data_parallel_size_local=local_size,
    )
    return _spawn(
        "stepscope.engine.core.core_proc",
        CoreProcArgs(
            config=dataclasses.asdict(rank_config),
            model_dir=str(model_dir),
            handshake_addr=handshake_addr,
            input_bind=input_bind,
            parent_pid=os.getpid(),
        ),
    )


class LoadBalancer:
    """Which DP rank gets the next request (vLLM: `DPLBAsyncMPClient.get_core_engine_for_request`).

    The score of a rank is 4 x waiting + running, as the coordinator last published them, plus
    the requests this client has sent there and not seen finish: the published counts lag by up
    to 100 ms, and a burst must not all land on the rank that looked idle. Ties go to the lower
    rank. Aborts go to the rank that holds the request.
    """

    def __init__(self, size: int) -> None:
        self.published = [(0, 0)] * size
        self.in_flight = [0] * size
        self.rank_of: dict[str, int] = {}

    def update(self, loads: list[list[int]]) -> str | None:
        """Take the coordinator's [waiting, running, lost] per rank; why the engine is dead if
        the coordinator lost a rank (no heartbeat), else None."""
        if len(loads) != len(self.published):
            return None
        self.published = [(w, r) for w, r, _ in loads]
        lost = [rank for rank, (_, _, gone) in enumerate(loads) if gone]
        if lost:
            return (
                f"the engine core of DP rank {lost[0]} stopped reporting to the DP coordinator "
                f"(no heartbeat for {RANK_TIMEOUT_S:.0f} s): its machine or process is gone"
            )
        return None

    def choose(self, request_id: str) -> int:
        size = len(self.in_flight)
        if size == 1:
            rank = 0
        else:
            rank = min(
                range(size),
                key=lambda i: 4 * self.published[i][0] + self.published[i][1] + self.in_flight[i],
            )
        self.rank_of[request_id] = rank
        self.in_flight[rank] += 1
        return rank

    def finished(self, request_id: str) -> None:
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            self.in_flight[rank] -= 1

    def by_rank(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The ranks holding `request_ids` (unknown ids, already finished, are left out)."""
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.rank_of.get(rid)
            if rank is not None:
                groups.setdefault(rank, []).append(rid)
        return groups

    def observe(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            if out.finish_reason is not None:
                self.finished(out.request_id)


def merge_utility_results(method: str, results: list[Any]) -> Any:
    """One answer from every rank's answer to a utility call."""
    if len(results) == 1:
        return results[0]
    if method == "reset_prefix_cache":
        return all(results)
    if method == "get_stats":
        return merge_stats(results)
    return results


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Engine statistics summed over DP ranks; ratios recomputed; each rank's own under
    `"ranks"`."""
    merged: dict[str, Any] = {}
    for stats in per_rank:
        for key, value in stats.items():
            if isinstance(value, list):
                old = merged.get(key, [0] * len(value))
                merged[key] = [a + b for a, b in zip(old, value, strict=True)]
            elif isinstance(value, int | float) and key != "crossing_median_s":
                merged[key] = merged.get(key, 0) + value
    total = merged.get("num_kv_blocks", 0)
    if total:
        merged["kv_cache_usage"] = 1 - merged["num_free_blocks"] / total
    medians = [s["crossing_median_s"] for s in per_rank if "crossing_median_s" in s]
    if medians:
        merged["crossing_median_s"] = max(medians)
    merged["ranks"] = per_rank
    return merged


class SyncMPClient:
    """Blocking client of the engine-core processes (used by `LLM(executor="mp")` and by any
    `LLM` with data_parallel_size > 1): one per DP rank, each request sent to the least-loaded."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="stepscope-api-")
        output_addr = f"ipc://{self._dir}/out"
        self.output_sock = self.ctx.socket(zmq.PULL)
        self.output_sock.bind(output_addr)
        try:
            self.group = EngineGroup(config, model_dir, [output_addr])
        except BaseException:
            self.output_sock.close(linger=0)
            self.ctx.term()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        handles = self.group.handles()
        self.dp = config.data_parallel_size
        self.handles = handles
        self.num_kv_blocks = handles.num_kv_blocks
        self.max_model_len = handles.max_model_len
        self.input_socks = [_connect(self.ctx, zmq.PUSH, a) for a in handles.input_addrs]
        self.balancer = LoadBalancer(self.dp)
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._outputs: queue.SimpleQueue[EngineCoreOutputs] = queue.SimpleQueue()
        self._utility: dict[int, dict[int, UtilityResult]] = {}
        self.dead_reason: str | None = None
        self._checked_at = 0.0
        self._poller = zmq.Poller()
        self._poller.register(self.output_sock, zmq.POLLIN)
        self._loads_sock = None
        if handles.publish_addr is not None:
            self._loads_sock = _connect(self.ctx, zmq.SUB, handles.publish_addr, subscribe=True)
            self._poller.register(self._loads_sock, zmq.POLLIN)

    def _check_alive(self) -> None:
        if self.dead_reason is None:
            self.dead_reason = self.group.dead_reason()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _receive(self) -> bool:
        """Wait up to one poll interval for messages and file them; False if none came."""
        ready = dict(self._poller.poll(POLL_MS))
        now = time.monotonic()
        if not ready or now - self._checked_at > POLL_MS / 1000:
            # Also while other ranks keep answering: a dead rank's requests wait on it.
            self._checked_at = now
            self._check_alive()
        if not ready:
            return False
        if self._loads_sock is not None and self._loads_sock in ready:
            lost = self.balancer.update(decode_loads(self._loads_sock.recv()))
            if lost is not None and self.dead_reason is None:
                self.dead_reason = lost
                raise EngineDeadError(lost)
        if self.output_sock in ready:
            kind, rank_frame, payload = self.output_sock.recv_multipart()
            rank = int(rank_frame)
            msg = decode_output(kind, payload, rank if self.dp > 1 else None)
            if kind == OutputKind.OUTPUTS:
                self.balancer.observe(msg)
                self._outputs.put(msg)
            elif kind == OutputKind.UTILITY:
                self._utility.setdefault(msg.call_id, {})[rank] = msg
            elif kind == OutputKind.DEAD:
                self.dead_reason = describe_rank(self.dp, rank, msg.reason)
                raise EngineDeadError(self.dead_reason)
        return True

    def add_request(self, request: EngineCoreRequest) -> int:
        """Send `request` to the least-loaded rank; returns that rank."""
        self._check_alive()
        rank = self.balancer.choose(request.request_id)
        self.input_socks[rank].send_multipart(
            [RequestKind.ADD, encode_request(request, rank if self.dp > 1 else None)]
        )
        return rank

    def abort_requests(self, request_ids: list[str]) -> None:
        self._check_alive()
        for rank, ids in self.balancer.by_rank(request_ids).items():
            self.input_socks[rank].send_multipart([RequestKind.ABORT, self._encoder.encode(ids)])
            for rid in ids:
                self.balancer.finished(rid)

    def get_output(self) -> EngineCoreOutputs:
        while self._outputs.empty():
            self._receive()
        return self._outputs.get()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call `method` on every rank's engine core; one merged answer."""
        self._check_alive()
        call_id = next(self._call_ids)
        data = self._encoder.encode(UtilityRequest(call_id, method, list(args)))
        for sock in self.input_socks:
            sock.send_multipart([RequestKind.UTILITY, data])
        while len(self._utility.get(call_id, ())) < self.dp:
            self._receive()
        results = self._utility.pop(call_id)
        errors = [r.error for r in results.values() if r.error is not None]
        if errors:
            raise RuntimeError(errors[0])
        return merge_utility_results(method, [results[r].result for r in range(self.dp)])

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo("api", 0, os.getpid()), *self.handles.processes()]

    def shutdown(self) -> None:
        if self.dead_reason is None:
            self.group.shutdown()
        self.group.stop()
        for sock in [*self.input_socks, self.output_sock]:
            sock.close(linger=0)
        if self._loads_sock is not None:
            self._loads_sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _connect(ctx: zmq.Context, kind: int, addr: str, subscribe: bool = False) -> zmq.Socket:
    sock = ctx.socket(kind)
    if subscribe:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(addr)
    return sock


class AsyncMPClient:
    """asyncio client of the engine-core processes (used by `AsyncLLM`), one per DP rank.

    Either it launches them (`AsyncMPClient(config, model_dir)`: one API server), or it attaches
    to those a launcher started (`attach`: API server `client_index` of several). One task reads
    the output socket and hands each EngineCoreOutputs to `on_outputs`; with DP > 1 another reads
    the coordinator's loads. A dead engine core or coordinator calls `on_dead` within a second:
    watched by pid on this machine, by the coordinator's heartbeat on another.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path | None = None,
        *,
        handles: EngineHandles | None = None,
        client_index: int = 0,
        output_addr: str | None = None,
    ) -> None:
        self.ctx = zmq.asyncio.Context()
        self._dir: str | None = None
        if output_addr is None:
            self._dir = tempfile.mkdtemp(prefix="stepscope-api-")
            output_addr = f"ipc://{self._dir}/out"
        self.output_sock = self.ctx.socket(zmq.PULL)
        self.output_sock.bind(output_addr)
        self.group: EngineGroup | None = None
        if handles is None:
            assert model_dir is not None
            try:
                self.group = EngineGroup(config, model_dir, [output_addr])
            except BaseException:
                self.output_sock.close(linger=0)
                self.ctx.term()
                raise
            handles = self.group.handles()
        self.handles = handles
        self.client_index = client_index
        self.dp = config.data_parallel_size
        self.input_socks = [_connect(self.ctx, zmq.PUSH, a) for a in handles.input_addrs]
        self.loads_sock = None
        if handles.publish_addr is not None:
            self.loads_sock = _connect(self.ctx, zmq.SUB, handles.publish_addr, subscribe=True)
        self.num_kv_blocks = handles.num_kv_blocks
        self.max_model_len = handles.max_model_len
        self.balancer = LoadBalancer(self.dp)
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._utility: dict[int, tuple[asyncio.Future, dict[int, UtilityResult]]] = {}
        self.dead_reason: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    def start(self, on_outputs, on_dead) -> None:
        """Begin reading outputs; call from inside the running event loop."""
        loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self._tasks.append(loop.create_task(self._read_loop(on_outputs)))
        if self.loads_sock is not None:
            self._tasks.append(loop.create_task(self._read_loads()))
        if self.group is not None:
            for proc, what in self.group.watched():
                threading.Thread(
                    target=self._watch_child, args=(loop, proc, what), daemon=True
                ).start()
        else:
            threading.Thread(target=self._watch_pids, args=(loop,), daemon=True).start()

    def _watch_child(self, loop: asyncio.AbstractEventLoop, proc, what: str) -> None:
        code = proc.wait()
        if not self._closed:
            loop.call_soon_threadsafe(self._mark_dead, f"{what} (exit code {code})")

    def _watch_pids(self, loop: asyncio.AbstractEventLoop) -> None:
        """Processes a launcher started are not our children: poll them by pid."""
        import psutil

        names = {p.pid: p for p in self.handles.processes()}
        while not self._closed:
            for pid in self.handles.local_pids:
                try:
                    gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    gone = True
                if gone and not self._closed:
                    info = names.get(pid)
                    if info is not None and info.role == "engine_core":
                        what = describe_rank(self.dp, info.dp_rank, "process died")
                    else:
                        what = "the DP coordinator process died"
                    loop.call_soon_threadsafe(self._mark_dead, what)
                    return
            time.sleep(POLL_MS / 1000)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        for fut, _ in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._on_dead(reason)

    async def _read_loads(self) -> None:
        assert self.loads_sock is not None
        while True:
            lost = self.balancer.update(decode_loads(await self.loads_sock.recv()))
            if lost is not None:
                self._mark_dead(lost)

    async def _read_loop(self, on_outputs) -> None:
        while True:
            kind, rank_frame, payload = await self.output_sock.recv_multipart()
            rank = int(rank_frame)
            msg = decode_output(kind, payload, rank if self.dp > 1 else None)
            if kind == OutputKind.OUTPUTS:
                self.balancer.observe(msg)
                on_outputs(msg)
            elif kind == OutputKind.UTILITY:
                self._file_utility(rank, msg)
            elif kind == OutputKind.DEAD:
                self._mark_dead(describe_rank(self.dp, rank, msg.reason))

    def _file_utility(self, rank: int, msg: UtilityResult) -> None:
        entry = self._utility.get(msg.call_id)
        if entry is None:
            return
        fut, results = entry
        results[rank] = msg
        if len(results) < self.dp or fut.done():
            return
        del self._utility[msg.call_id]
        errors = [r.error for r in results.values() if r.error is not None]
        if errors:
            fut.set_exception(RuntimeError(errors[0]))
        else:
            fut.set_result([results[r].result for r in range(self.dp)])

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    async def add_request(self, request: EngineCoreRequest) -> int:
        """Send `request` to the least-loaded rank; returns that rank."""
        self._check_alive()
        rank = self.balancer.choose(request.request_id)
        request.client_index = self.client_index
        data = encode_request(request, rank if self.dp > 1 else None)
        await self.input_socks[rank].send_multipart([RequestKind.ADD, data])
        return rank

    async def abort_requests(self, request_ids: list[str]) -> None:
        groups = self.balancer.by_rank(request_ids)
        for ids in groups.values():
            for rid in ids:
                self.balancer.finished(rid)
        if self.dead_reason is None:
            for rank, ids in groups.items():
                await self.input_socks[rank].send_multipart(
                    [RequestKind.ABORT, self._encoder.encode(ids)]
                )

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call `method` on every rank's engine core; one merged answer."""
        self._check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility[call_id] = (fut, {})
        msg = UtilityRequest(call_id, method, list(args), self.client_index)
        data = self._encoder.encode(msg)
        for sock in self.input_socks:
            await sock.send_multipart([RequestKind.UTILITY, data])
        return merge_utility_results(method, await fut)

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo("api", self.client_index, os.getpid()), *self.handles.processes()]

    def shutdown(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self.group is not None:  # ours to stop; a launcher stops what it started
            if self.dead_reason is None:
                self.group.shutdown()
            self.group.stop()
        for sock in [*self.input_socks, self.output_sock]:
            sock.close(linger=0)
        if self.loads_sock is not None:
            self.loads_sock.close(linger=0)
        self.ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
