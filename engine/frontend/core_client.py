"""Clients of the engine core, as the API process sees it (the API -> engine core boundary).

- `InprocClient`: the engine core in this process, stepped directly (offline default, no ZMQ).
- `SyncMPClient`: the engine core in its own process over ZMQ, with blocking calls (`LLM`).
- `AsyncMPClient`: the same process over asyncio ZMQ sockets (`AsyncLLM`, the server).
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
import uuid
import weakref
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from stepscope.engine.config import EngineConfig
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

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

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


def encode_request(request: EngineCoreRequest) -> bytes:
    """An EngineCoreRequest as bytes, sent under the current span (the request's)."""
    return traced_send(crossing.API_TO_ENGINE_CORE, _REQUEST_ENCODER.encode, request)


def decode_output(kind: bytes, payload: bytes) -> Any:
    """A message from the engine core; EngineCoreOutputs with their receive span."""
    if kind == OutputKind.OUTPUTS:
        return traced_receive(crossing.ENGINE_CORE_TO_API, _DECODERS[kind].decode, payload)
    return _DECODERS[kind].decode(payload)


class _CoreProcess:
    """Starts the engine-core process, waits for its readiness handshake, stops it at exit."""

    def __init__(self, config: EngineConfig, model_dir: Path, ctx: zmq.Context) -> None:
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
                )
            )
        )
        self.proc.stdin.close()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self._dir)
        self.ready = self._wait_ready()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def _wait_ready(self) -> EngineCoreReady:
        waited = 0.0
        while waited < STARTUP_TIMEOUT_S:
            if self.output_sock.poll(POLL_MS):
                kind, payload = self.output_sock.recv_multipart()
                msg = _DECODERS[kind].decode(payload)
                if kind == OutputKind.READY:
                    return msg
                if kind == OutputKind.DEAD:
                    self.stop()
                    raise EngineDeadError(msg.reason)
            if not self.alive:
                self.stop()
                raise EngineDeadError(
                    f"the engine core exited during start-up (exit code {self.exitcode}); "
                    "its error is printed above"
                )
            waited += POLL_MS / 1000
        self.stop()
        raise EngineDeadError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        self._finalizer()


def _stop_process(proc: subprocess.Popen, folder: str) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: the core stops its workers on the way out
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)
    for f in Path(folder).glob("*"):
        f.unlink(missing_ok=True)
    Path(folder).rmdir()


class SyncMPClient:
    """Blocking client of an engine core in its own process (used by `LLM(executor="mp")`)."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.ctx = zmq.Context()
        self.process = _CoreProcess(config, model_dir, self.ctx)
        self.num_kv_blocks = self.process.ready.num_kv_blocks
        self.max_model_len = self.process.ready.max_model_len
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._outputs: queue.SimpleQueue[EngineCoreOutputs] = queue.SimpleQueue()
        self._utility: dict[int, UtilityResult] = {}
        self.dead_reason: str | None = None

    def _send(self, kind: bytes, msg: Any) -> None:
        self._check_alive()
        self.process.input_sock.send_multipart([kind, self._encoder.encode(msg)])

    def _check_alive(self) -> None:
        if self.dead_reason is None and not self.process.alive:
            self.dead_reason = f"the engine core process died (exit code {self.process.exitcode})"
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _receive_one(self) -> bool:
        """Wait up to one poll interval for a message and file it; False if none came."""
        if not self.process.output_sock.poll(POLL_MS):
            self._check_alive()
            return False
        kind, payload = self.process.output_sock.recv_multipart()
        msg = decode_output(kind, payload)
        if kind == OutputKind.OUTPUTS:
            self._outputs.put(msg)
        elif kind == OutputKind.UTILITY:
            self._utility[msg.call_id] = msg
        elif kind == OutputKind.DEAD:
            self.dead_reason = msg.reason
            raise EngineDeadError(msg.reason)
        return True

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.process.input_sock.send_multipart([RequestKind.ADD, encode_request(request)])

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(RequestKind.ABORT, request_ids)

    def get_output(self) -> EngineCoreOutputs:
        while self._outputs.empty():
            self._receive_one()
        return self._outputs.get()

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._send(RequestKind.UTILITY, UtilityRequest(call_id, method, list(args)))
        while call_id not in self._utility:
            self._receive_one()
        result = self._utility.pop(call_id)
        if result.error is not None:
            raise RuntimeError(result.error)
        return result.result

    def processes(self) -> list[ProcessInfo]:
        api = ProcessInfo("api", 0, os.getpid())
        return [api, *self.process.ready.processes]

    def shutdown(self) -> None:
        if self.process.alive and self.dead_reason is None:
            with contextlib.suppress(zmq.ZMQError, subprocess.TimeoutExpired):
                self.process.input_sock.send_multipart([RequestKind.SHUTDOWN, b""])
                self.process.proc.wait(10)
        self.process.stop()
        self.process.input_sock.close(linger=0)
        self.process.output_sock.close(linger=0)
        self.ctx.term()


class AsyncMPClient:
    """asyncio client of an engine core in its own process (used by `AsyncLLM`).

    One task reads the output socket and hands each EngineCoreOutputs to `on_outputs`; a
    watchdog thread notices a dead core process and calls `on_dead` within a second.
    """

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.ctx = zmq.asyncio.Context()
        # Start-up handshake over plain blocking sockets, then switch to asyncio ones.
        sync_ctx = zmq.Context()
        self.process = _CoreProcess(config, model_dir, sync_ctx)
        self.process.input_sock.close(linger=0)
        self.process.output_sock.close(linger=0)
        sync_ctx.term()
        self.input_sock = self.ctx.socket(zmq.PUSH)
        self.input_sock.bind(self.process.input_addr)
        self.output_sock = self.ctx.socket(zmq.PULL)
        self.output_sock.bind(self.process.output_addr)
        self.num_kv_blocks = self.process.ready.num_kv_blocks
        self.max_model_len = self.process.ready.max_model_len
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._utility: dict[int, asyncio.Future] = {}
        self.dead_reason: str | None = None
        self._reader: asyncio.Task | None = None
        self._closed = False

    def start(self, on_outputs, on_dead) -> None:
        """Begin reading outputs; call from inside the running event loop."""
        loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self._reader = loop.create_task(self._read_loop(on_outputs))
        threading.Thread(target=self._watchdog, args=(loop,), daemon=True).start()

    def _watchdog(self, loop: asyncio.AbstractEventLoop) -> None:
        self.process.proc.wait()
        if not self._closed:
            reason = f"the engine core process died (exit code {self.process.exitcode})"
            loop.call_soon_threadsafe(self._mark_dead, reason)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._on_dead(reason)

    async def _read_loop(self, on_outputs) -> None:
        while True:
            kind, payload = await self.output_sock.recv_multipart()
            msg = decode_output(kind, payload)
            if kind == OutputKind.OUTPUTS:
                on_outputs(msg)
            elif kind == OutputKind.UTILITY:
                fut = self._utility.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    if msg.error is not None:
                        fut.set_exception(RuntimeError(msg.error))
                    else:
                        fut.set_result(msg.result)
            elif kind == OutputKind.DEAD:
                self._mark_dead(msg.reason)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        await self.input_sock.send_multipart([RequestKind.ADD, encode_request(request)])

    async def abort_requests(self, request_ids: list[str]) -> None:
        if self.dead_reason is None:
            await self.input_sock.send_multipart(
                [RequestKind.ABORT, self._encoder.encode(request_ids)]
            )

    async def call_utility(self, method: str, *args: Any) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility[call_id] = fut
        msg = UtilityRequest(call_id, method, list(args))
        await self.input_sock.send_multipart([RequestKind.UTILITY, self._encoder.encode(msg)])
        return await fut

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo("api", 0, os.getpid()), *self.process.ready.processes]

    def shutdown(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        if self.process.alive and self.dead_reason is None:
            with contextlib.suppress(zmq.ZMQError, subprocess.TimeoutExpired):
                self.input_sock.send_multipart([RequestKind.SHUTDOWN, b""])
                self.process.proc.wait(10)
        self.process.stop()
        self.input_sock.close(linger=0)
        self.output_sock.close(linger=0)
        self.ctx.term()
