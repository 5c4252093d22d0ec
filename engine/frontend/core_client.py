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
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.dp_coordinator import CoordinatorArgs, decode_loads
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.messages import (
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


class _CoreProcess:
    """Starts one engine-core process (one DP rank) and stops it at exit; `wait_ready` waits for
    its readiness handshake, so that several ranks can start side by side."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        ctx: zmq.Context,
        coordinator_addr: str | None = None,
    ) -> None:
        self.dp_rank = config.data_parallel_rank
        self._dir = tempfile.mkdtemp(prefix="stepscope-")
        name = uuid.uuid4().hex[:8]
        self.input_addr = f"ipc://{self._dir}/{name}-in"
        self.output_addr = f"ipc://{self._dir}/{name}-out"
        # The client binds both sockets, so the core can connect whenever it is ready.
        self.input_sock = ctx.socket(zmq.PUSH)
        self.input_sock.bind(self.input_addr)
        self.output_sock = ctx.socket(zmq.PULL)
        self.output_sock.bind(self.output_addr)
        # A fresh interpreter, not multiprocessing: nothing of this process (its __main__, its
        # threads, its tracer provider) is inherited, and user scripts need no __main__ guard.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stepscope.engine.core.core_proc"], stdin=subprocess.PIPE
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            msgspec.msgpack.encode(
                CoreProcArgs(
                    config=dataclasses.asdict(config),
                    model_dir=str(model_dir),
                    input_addr=self.input_addr,
                    output_addr=self.output_addr,
                    parent_pid=os.getpid(),
                    coordinator_addr=coordinator_addr,
                )
            )
        )
        self.proc.stdin.close()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self._dir)
        self.ready: EngineCoreReady | None = None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def wait_ready(self) -> EngineCoreReady:
        waited = 0.0
        while waited < STARTUP_TIMEOUT_S:
            if self.output_sock.poll(POLL_MS):
                kind, payload = self.output_sock.recv_multipart()
                msg = _DECODERS[kind].decode(payload)
                if kind == OutputKind.READY:
                    self.ready = msg
                    return msg
                if kind == OutputKind.DEAD:
                    raise EngineDeadError(msg.reason)
            if not self.alive:
                raise EngineDeadError(
                    f"the engine core exited during start-up (exit code {self.exitcode}); "
                    "its error is printed above"
                )
            waited += POLL_MS / 1000
        raise EngineDeadError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        self._finalizer()


def _stop_process(proc: subprocess.Popen, folder: str | None = None) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: the core stops its workers on the way out
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)
    if folder is not None:
        for f in Path(folder).glob("*"):
            f.unlink(missing_ok=True)
        Path(folder).rmdir()


class _CoordinatorProcess:
    """The DP coordinator (engine/core/dp_coordinator.py), started when DP > 1."""

    def __init__(self, data_parallel_size: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="stepscope-dp-")
        self.stats_addr = f"ipc://{self._dir}/stats"
        self.publish_addr = f"ipc://{self._dir}/publish"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stepscope.engine.core.dp_coordinator"], stdin=subprocess.PIPE
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            msgspec.msgpack.encode(
                CoordinatorArgs(data_parallel_size, self.stats_addr, self.publish_addr, os.getpid())
            )
        )
        self.proc.stdin.close()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self._dir)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self._finalizer()


class EngineGroup:
    """Every engine-core process behind one client: one per DP rank, plus the coordinator when
    there are several. Starting one rank fails the whole group, and stops what did start."""

    def __init__(self, config: EngineConfig, model_dir: Path, ctx: zmq.Context) -> None:
        size = config.data_parallel_size
        self.coordinator = _CoordinatorProcess(size) if size > 1 else None
        coordinator_addr = self.coordinator.stats_addr if self.coordinator else None
        self.cores: list[_CoreProcess] = []
        try:
            for rank in range(size):
                rank_config = dataclasses.replace(config, data_parallel_rank=rank)
                self.cores.append(_CoreProcess(rank_config, model_dir, ctx, coordinator_addr))
            for core in self.cores:
                try:
                    core.wait_ready()
                except EngineDeadError as e:
                    prefix = f"DP rank {core.dp_rank}: " if size > 1 else ""
                    raise EngineDeadError(prefix + str(e)) from None
        except BaseException:
            self.stop()
            raise
        first = self.cores[0].ready
        assert first is not None
        self.num_kv_blocks = first.num_kv_blocks
        self.max_model_len = first.max_model_len

    def dead_reason(self) -> str | None:
        """Why the group cannot serve any more (a process exited), or None; never blocks."""
        for core in self.cores:
            if not core.alive:
                return self.describe(core.dp_rank, f"process died (exit code {core.exitcode})")
        if self.coordinator is not None and not self.coordinator.alive:
            return f"the DP coordinator process died (exit code {self.coordinator.proc.poll()})"
        return None

    def describe(self, rank: int, what: str) -> str:
        if len(self.cores) == 1:
            return f"the engine core {what}"
        return f"the engine core of DP rank {rank} {what}"

    def processes(self) -> list[ProcessInfo]:
        coordinator = (
            [ProcessInfo("dp_coordinator", 0, self.coordinator.proc.pid)]
            if self.coordinator is not None
            else []
        )
        cores = [p for core in self.cores if core.ready for p in core.ready.processes]
        return [ProcessInfo("api", 0, os.getpid()), *coordinator, *cores]

    def stop(self) -> None:
        for core in self.cores:
            core.stop()
        if self.coordinator is not None:
            self.coordinator.stop()


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

    def update(self, loads: list[list[int]]) -> None:
        if len(loads) == len(self.published):
            self.published = [(w, r) for w, r in loads]

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
        self.group = EngineGroup(config, model_dir, self.ctx)
        self.cores = self.group.cores
        self.dp = len(self.cores)
        self.num_kv_blocks = self.group.num_kv_blocks
        self.max_model_len = self.group.max_model_len
        self.balancer = LoadBalancer(self.dp)
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._outputs: queue.SimpleQueue[EngineCoreOutputs] = queue.SimpleQueue()
        self._utility: dict[int, dict[int, UtilityResult]] = {}
        self.dead_reason: str | None = None
        self._checked_at = 0.0
        self._poller = zmq.Poller()
        self._rank_of_socket: dict[zmq.Socket, int] = {}
        for core in self.cores:
            self._poller.register(core.output_sock, zmq.POLLIN)
            self._rank_of_socket[core.output_sock] = core.dp_rank
        self._loads_sock = None
        if self.group.coordinator is not None:
            self._loads_sock = self.ctx.socket(zmq.SUB)
            self._loads_sock.setsockopt(zmq.SUBSCRIBE, b"")
            self._loads_sock.connect(self.group.coordinator.publish_addr)
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
            self.balancer.update(decode_loads(self._loads_sock.recv()))
        for sock, rank in self._rank_of_socket.items():
            if sock not in ready:
                continue
            kind, payload = sock.recv_multipart()
            msg = decode_output(kind, payload, self._span_rank(rank))
            if kind == OutputKind.OUTPUTS:
                self.balancer.observe(msg)
                self._outputs.put(msg)
            elif kind == OutputKind.UTILITY:
                self._utility.setdefault(msg.call_id, {})[rank] = msg
            elif kind == OutputKind.DEAD:
                self.dead_reason = self.group.describe(rank, f"failed: {msg.reason}")
                raise EngineDeadError(self.dead_reason)
        return True

    def _span_rank(self, rank: int) -> int | None:
        return rank if self.dp > 1 else None

    def add_request(self, request: EngineCoreRequest) -> int:
        """Send `request` to the least-loaded rank; returns that rank."""
        self._check_alive()
        rank = self.balancer.choose(request.request_id)
        self.cores[rank].input_sock.send_multipart(
            [RequestKind.ADD, encode_request(request, self._span_rank(rank))]
        )
        return rank

    def abort_requests(self, request_ids: list[str]) -> None:
        self._check_alive()
        for rank, ids in self.balancer.by_rank(request_ids).items():
            self.cores[rank].input_sock.send_multipart(
                [RequestKind.ABORT, self._encoder.encode(ids)]
            )
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
        for core in self.cores:
            core.input_sock.send_multipart([RequestKind.UTILITY, data])
        while len(self._utility.get(call_id, ())) < self.dp:
            self._receive()
        results = self._utility.pop(call_id)
        errors = [r.error for r in results.values() if r.error is not None]
        if errors:
            raise RuntimeError(errors[0])
        return merge_utility_results(method, [results[r].result for r in range(self.dp)])

    def processes(self) -> list[ProcessInfo]:
        return self.group.processes()

    def shutdown(self) -> None:
        if self.dead_reason is None:
            for core in self.cores:
                if core.alive:
                    with contextlib.suppress(zmq.ZMQError):
                        core.input_sock.send_multipart([RequestKind.SHUTDOWN, b""])
            for core in self.cores:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    core.proc.wait(10)
        self.group.stop()
        for core in self.cores:
            core.input_sock.close(linger=0)
            core.output_sock.close(linger=0)
        if self._loads_sock is not None:
            self._loads_sock.close(linger=0)
        self.ctx.term()


class AsyncMPClient:
    """asyncio client of the engine-core processes (used by `AsyncLLM`), one per DP rank.

    One task per rank reads its output socket and hands each EngineCoreOutputs to `on_outputs`;
    with DP > 1 another reads the coordinator's loads. A watchdog thread per process notices a
    dead engine core (or coordinator) and calls `on_dead` within a second.
    """

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.ctx = zmq.asyncio.Context()
        # Start-up handshake over plain blocking sockets, then switch to asyncio ones.
        sync_ctx = zmq.Context()
        self.group = EngineGroup(config, model_dir, sync_ctx)
        self.dp = len(self.group.cores)
        self.input_socks: list[zmq.asyncio.Socket] = []
        self.output_socks: list[zmq.asyncio.Socket] = []
        for core in self.group.cores:
            core.input_sock.close(linger=0)
            core.output_sock.close(linger=0)
            self.input_socks.append(self.ctx.socket(zmq.PUSH))
            self.input_socks[-1].bind(core.input_addr)
            self.output_socks.append(self.ctx.socket(zmq.PULL))
            self.output_socks[-1].bind(core.output_addr)
        sync_ctx.term()
        self.loads_sock = None
        if self.group.coordinator is not None:
            self.loads_sock = self.ctx.socket(zmq.SUB)
            self.loads_sock.setsockopt(zmq.SUBSCRIBE, b"")
            self.loads_sock.connect(self.group.coordinator.publish_addr)
        self.num_kv_blocks = self.group.num_kv_blocks
        self.max_model_len = self.group.max_model_len
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
        for rank in range(self.dp):
            self._tasks.append(loop.create_task(self._read_loop(rank, on_outputs)))
        if self.loads_sock is not None:
            self._tasks.append(loop.create_task(self._read_loads()))
        procs = [(c.dp_rank, c.proc) for c in self.group.cores]
        if self.group.coordinator is not None:
            procs.append((None, self.group.coordinator.proc))
        for rank, proc in procs:
            threading.Thread(target=self._watchdog, args=(loop, rank, proc), daemon=True).start()

    def _watchdog(self, loop: asyncio.AbstractEventLoop, rank: int | None, proc) -> None:
        code = proc.wait()
        if not self._closed:
            if rank is None:
                reason = f"the DP coordinator process died (exit code {code})"
            else:
                reason = self.group.describe(rank, f"process died (exit code {code})")
            loop.call_soon_threadsafe(self._mark_dead, reason)

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
            self.balancer.update(decode_loads(await self.loads_sock.recv()))

    async def _read_loop(self, rank: int, on_outputs) -> None:
        span_rank = rank if self.dp > 1 else None
        while True:
            kind, payload = await self.output_socks[rank].recv_multipart()
            msg = decode_output(kind, payload, span_rank)
            if kind == OutputKind.OUTPUTS:
                self.balancer.observe(msg)
                on_outputs(msg)
            elif kind == OutputKind.UTILITY:
                self._file_utility(rank, msg)
            elif kind == OutputKind.DEAD:
                self._mark_dead(self.group.describe(rank, f"failed: {msg.reason}"))

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
        data = self._encoder.encode(UtilityRequest(call_id, method, list(args)))
        for sock in self.input_socks:
            await sock.send_multipart([RequestKind.UTILITY, data])
        return merge_utility_results(method, await fut)

    def processes(self) -> list[ProcessInfo]:
        return self.group.processes()

    def shutdown(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self.dead_reason is None:
            for sock, core in zip(self.input_socks, self.group.cores, strict=True):
                if core.alive:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send_multipart([RequestKind.SHUTDOWN, b""])
            for core in self.group.cores:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    core.proc.wait(10)
        self.group.stop()
        for sock in [*self.input_socks, *self.output_socks]:
            sock.close(linger=0)
        if self.loads_sock is not None:
            self.loads_sock.close(linger=0)
        self.ctx.term()
