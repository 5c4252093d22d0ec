"""Clients of the engine core, as the API process sees it (the API -> engine core boundary).

- `InprocClient`: the engine core in this process, stepped directly (offline default, no ZMQ).
- `SyncMPClient`: engine cores in their own processes over ZMQ, with blocking calls (`LLM`).
- `AsyncMPClient`: the same processes over asyncio ZMQ sockets (`AsyncLLM`, the server).
The two MP clients share `MPClient` (vLLM: the same name): the sockets, the engine group they
start when nobody else did (engine_group.py), the reply router and shutdown. With data
parallelism (DP > 1) there is one engine-core process per rank and a coordinator process; the MP
clients send each request to the least-loaded rank (`LoadBalancer`, load_balancer.py), aborts to
the rank that holds it, utility calls to every rank.
Requests go out as EngineCoreRequest; EngineCoreOutputs (token ids, never text) come back.
A dead engine core turns every waiting call into EngineDeadError within seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from stepscope.engine.config import Endpoints, EngineConfig
from stepscope.engine.core.dp_coordinator import decode_loads
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.frontend.engine_group import (
    Attachment,
    EngineDeadError,
    EngineGroup,
    describe_rank,
)
from stepscope.engine.frontend.load_balancer import LoadBalancer, merge_utility_results
from stepscope.engine.liveness import ENGINE_PROCESS_POLL_S
from stepscope.engine.messages import (
    ENGINE_CORE_UTILITY_METHODS,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    OutputKind,
    ProcessInfo,
    RequestKind,
    UtilityRequest,
    UtilityResult,
    call_utility,
)
from stepscope.traces import crossing
from stepscope.traces.crossing import traced_receive, traced_send


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
        return call_utility(self.core, ENGINE_CORE_UTILITY_METHODS, method, args)

    def processes(self) -> list[ProcessInfo]:
        return self.core.processes()

    def shutdown(self) -> None:
        self.core.shutdown()


# What an engine core sends to an API server's output socket.
_DECODERS = {
    OutputKind.OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
    OutputKind.UTILITY: msgspec.msgpack.Decoder(UtilityResult),
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


def _connect(ctx: zmq.Context, kind: int, addr: str, subscribe: bool = False) -> zmq.Socket:
    sock = ctx.socket(kind)
    if subscribe:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(addr)
    return sock


# A utility call's answer: a concurrent.futures.Future (sync) or an asyncio.Future (async).
_Future = concurrent.futures.Future | asyncio.Future


class MPClient:
    """What both MP clients share (vLLM: `MPClient`): the output socket (bound here), an input
    socket per DP rank, the coordinator's loads (DP > 1), the load balancer, the reply router and
    shutdown.

    Either it launches the engine cores (`handles=None`: an `EngineGroup` of its own, stopped at
    shutdown), or it attaches to those a launcher started (`handles`, as API server
    `client_index`). Subclasses say how to wait for replies and what a death does
    (`_mark_dead`).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        config: EngineConfig,
        model_dir: Path | None,
        endpoints: Endpoints,
        attach: Attachment | None = None,
    ) -> None:
        self.ctx = ctx
        self._dir: str | None = None
        if attach is None:  # our own engine cores, answering at a socket of ours
            self._dir = tempfile.mkdtemp(prefix="stepscope-api-")
            output_addr = f"ipc://{self._dir}/out"
            if config.parallel_config.data_parallel_backend == "ray":
                from stepscope.engine.executor import ray_utils

                ray_utils.connect_for(config, endpoints.ray_address)
                output_addr = ray_utils.output_address(self._dir)
        else:
            output_addr = attach.output_addr
        self.output_sock = self.ctx.socket(zmq.PULL)
        self.output_sock.bind(output_addr)
        self.group: EngineGroup | None = None
        if attach is not None:
            handles = attach.handles
        else:
            assert model_dir is not None
            try:
                self.group = EngineGroup(config, model_dir, endpoints, [output_addr])
            except BaseException:
                self.output_sock.close(linger=0)
                self.ctx.term()
                if self._dir is not None:
                    shutil.rmtree(self._dir, ignore_errors=True)
                raise
            handles = self.group.handles()
        self.handles = handles
        self.client_index = attach.client_index if attach else 0
        self.dp = config.parallel_config.data_parallel_size
        self.input_socks = [_connect(self.ctx, zmq.PUSH, a) for a in handles.input_addrs]
        self.loads_sock = None
        if handles.publish_addr is not None:
            self.loads_sock = _connect(self.ctx, zmq.SUB, handles.publish_addr, subscribe=True)
        self.num_kv_blocks = handles.num_kv_blocks
        self.max_model_len = handles.max_model_len
        self.balancer = LoadBalancer(self.dp)
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._utility: dict[int, tuple[_Future, dict[int, UtilityResult]]] = {}
        self.dead_reason: str | None = None
        self._closed = False

    def _mark_dead(self, reason: str) -> None:
        """The first death wins: fail every utility call still waiting."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        for fut, _ in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    def _route_reply(
        self, frames: list[bytes], on_outputs: Callable[[EngineCoreOutputs], Any]
    ) -> None:
        """File one message from an engine core: outputs to `on_outputs` once the balancer saw
        which requests finished, a utility result to its call, a death to `_mark_dead`."""
        kind, rank_frame, payload = frames
        rank = int(rank_frame)
        msg = decode_output(kind, payload, rank if self.dp > 1 else None)
        if kind == OutputKind.OUTPUTS:
            self.balancer.observe(msg)
            on_outputs(msg)
        elif kind == OutputKind.UTILITY:
            self._file_utility(rank, msg)
        elif kind == OutputKind.DEAD:
            self._mark_dead(describe_rank(self.dp, rank, msg.reason))

    def _route_loads(self, data: bytes) -> None:
        """Take the coordinator's loads; a rank it lost is a death."""
        lost = self.balancer.update(decode_loads(data))
        if lost is not None:
            self._mark_dead(lost)

    def _file_utility(self, rank: int, msg: UtilityResult) -> None:
        """Answer a utility call once every rank has: its first error, else every rank's result."""
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

    def _add_frames(self, request: EngineCoreRequest) -> tuple[int, list[bytes]]:
        """The least-loaded rank for `request`, and the frames that send it there."""
        self._check_alive()
        rank = self.balancer.choose(request.request_id)
        request.client_index = self.client_index
        return rank, [RequestKind.ADD, encode_request(request, rank if self.dp > 1 else None)]

    def _abort_frames(self, request_ids: list[str]) -> dict[int, list[bytes]]:
        """Forget `request_ids` in the balancer; the frames that abort them, by rank."""
        groups = self.balancer.by_rank(request_ids)
        for ids in groups.values():
            for rid in ids:
                self.balancer.finished(rid)
        return {
            rank: [RequestKind.ABORT, self._encoder.encode(ids)] for rank, ids in groups.items()
        }

    def _utility_frames(self, fut: _Future, method: str, args: tuple) -> list[bytes]:
        """Register a call of `method` on every rank, answered through `fut`; its frames."""
        self._check_alive()
        call_id = next(self._call_ids)
        self._utility[call_id] = (fut, {})
        msg = UtilityRequest(call_id, method, list(args), self.client_index)
        return [RequestKind.UTILITY, self._encoder.encode(msg)]

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo("api", self.client_index, os.getpid()), *self.handles.processes()]

    def shutdown(self) -> None:
        self._closed = True
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


class SyncMPClient(MPClient):
    """Blocking client of the engine-core processes (used by `LLM(executor="mp")` and by any
    `LLM` with data_parallel_size > 1): one per DP rank, each request sent to the least-loaded.
    A death raises EngineDeadError in the call that finds it."""

    def __init__(
        self, config: EngineConfig, model_dir: Path, endpoints: Endpoints | None = None
    ) -> None:
        super().__init__(zmq.Context(), config, model_dir, endpoints or Endpoints())
        self._outputs: queue.SimpleQueue[EngineCoreOutputs] = queue.SimpleQueue()
        self._checked_at = 0.0
        self._poller = zmq.Poller()
        self._poller.register(self.output_sock, zmq.POLLIN)
        if self.loads_sock is not None:
            self._poller.register(self.loads_sock, zmq.POLLIN)

    def _mark_dead(self, reason: str) -> None:
        super()._mark_dead(reason)
        raise EngineDeadError(self.dead_reason)

    def _check_alive(self) -> None:
        assert self.group is not None
        reason = self.dead_reason or self.group.dead_reason()
        if reason is not None:
            self._mark_dead(reason)

    def _receive(self) -> bool:
        """Wait up to one poll interval for messages and file them; False if none came."""
        ready = dict(self._poller.poll(int(ENGINE_PROCESS_POLL_S * 1000)))
        now = time.monotonic()
        if not ready or now - self._checked_at > ENGINE_PROCESS_POLL_S:
            # Also while other ranks keep answering: a dead rank's requests wait on it.
            self._checked_at = now
            self._check_alive()
        if not ready:
            return False
        if self.loads_sock is not None and self.loads_sock in ready:
            self._route_loads(self.loads_sock.recv())
        if self.output_sock in ready:
            self._route_reply(self.output_sock.recv_multipart(), self._outputs.put)
        return True

    def add_request(self, request: EngineCoreRequest) -> int:
        """Send `request` to the least-loaded rank; returns that rank."""
        rank, frames = self._add_frames(request)
        self.input_socks[rank].send_multipart(frames)
        return rank

    def abort_requests(self, request_ids: list[str]) -> None:
        self._check_alive()
        for rank, frames in self._abort_frames(request_ids).items():
            self.input_socks[rank].send_multipart(frames)

    def get_output(self) -> EngineCoreOutputs:
        while self._outputs.empty():
            self._receive()
        return self._outputs.get()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call `method` on every rank's engine core; one merged answer."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        frames = self._utility_frames(fut, method, args)
        for sock in self.input_socks:
            sock.send_multipart(frames)
        while not fut.done():
            self._receive()
        return merge_utility_results(method, fut.result())


class AsyncMPClient(MPClient):
    """asyncio client of the engine-core processes (used by `AsyncLLM`), one per DP rank.

    Either it launches them (`AsyncMPClient(config, model_dir)`: one API server), or it attaches
    to those a launcher started (`handles`: API server `client_index` of several). One task reads
    the output socket and hands each EngineCoreOutputs to `on_outputs`; with DP > 1 another reads
    the coordinator's loads. A dead engine core or coordinator calls `on_dead` within a second:
    watched by pid on this machine, by the coordinator's heartbeat on another.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path | None = None,
        endpoints: Endpoints | None = None,
        attach: Attachment | None = None,
    ) -> None:
        super().__init__(zmq.asyncio.Context(), config, model_dir, endpoints or Endpoints(), attach)
        self._tasks: list[asyncio.Task] = []

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
            time.sleep(ENGINE_PROCESS_POLL_S)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            super()._mark_dead(reason)
            self._on_dead(reason)

    async def _read_loads(self) -> None:
        assert self.loads_sock is not None
        while True:
            self._route_loads(await self.loads_sock.recv())

    async def _read_loop(self, on_outputs) -> None:
        while True:
            self._route_reply(await self.output_sock.recv_multipart(), on_outputs)

    async def add_request(self, request: EngineCoreRequest) -> int:
        """Send `request` to the least-loaded rank; returns that rank."""
        rank, frames = self._add_frames(request)
        await self.input_socks[rank].send_multipart(frames)
        return rank

    async def abort_requests(self, request_ids: list[str]) -> None:
        aborts = self._abort_frames(request_ids)
        if self.dead_reason is None:
            for rank, frames in aborts.items():
                await self.input_socks[rank].send_multipart(frames)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call `method` on every rank's engine core; one merged answer."""
        fut = asyncio.get_running_loop().create_future()
        frames = self._utility_frames(fut, method, args)
        for sock in self.input_socks:
            await sock.send_multipart(frames)
        return merge_utility_results(method, await fut)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        super().shutdown()
