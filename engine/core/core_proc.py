"""The engine-core process: a busy loop that only schedules, executes and updates (stages 3-8).

Two IO threads bridge the ZMQ sockets and two queues, so the loop never touches a socket:
the input thread decodes requests (ADD, ABORT, UTILITY) onto the input queue, the output thread
encodes EngineCoreOutputs off the output queue. Each turn the loop drains the input queue, then
runs one step if any request is unfinished; with nothing to do it blocks on the input queue.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import zmq

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.messages import (
    CoreProcArgs,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineDead,
    OutputKind,
    RankLoad,
    RequestKind,
    UtilityRequest,
    UtilityResult,
)
from stepscope.traces import crossing, names
from stepscope.traces.crossing import traced_receive, traced_send
from stepscope.traces.process import watch_parent
from stepscope.traces.setup import dropped_spans, init_process_tracing, shutdown_tracing

_LOAD = b"load"  # output-queue item for the DP coordinator's socket, not the API's


class EngineCoreProc:
    def __init__(
        self,
        engine_core: EngineCore,
        input_addr: str,
        output_addr: str,
        coordinator_addr: str | None = None,
    ) -> None:
        self.core = engine_core
        self.dp_rank = engine_core.config.data_parallel_rank
        self._coordinator_addr = coordinator_addr
        self._last_load: tuple[int, int] | None = None
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[bytes, Any] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self.running = True
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(input_addr,), name="core-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_loop, args=(output_addr,), name="core-output", daemon=True
        )
        self._output_thread.start()
        self._input_thread.start()

    # ---- IO threads ---------------------------------------------------------------------------
    def _input_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(addr)
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        utility_decoder = msgspec.msgpack.Decoder(UtilityRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        while self.running:
            if not sock.poll(200):
                continue
            kind, payload = sock.recv_multipart(copy=False)
            kind = bytes(kind.buffer)
            if kind == RequestKind.ADD:
                request = traced_receive(
                    crossing.API_TO_ENGINE_CORE, add_decoder.decode, payload.buffer
                )
                # Queued from now (stage 3), though the busy loop may still be in a step.
                self.input_queue.put((kind, (request, time.time())))
            elif kind == RequestKind.ABORT:
                self.input_queue.put((kind, abort_decoder.decode(payload.buffer)))
            elif kind == RequestKind.UTILITY:
                self.input_queue.put((kind, utility_decoder.decode(payload.buffer)))
            elif kind == RequestKind.SHUTDOWN:
                self.input_queue.put((kind, None))
        sock.close(linger=0)

    def _output_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(addr)
        load_sock = None
        if self._coordinator_addr is not None:
            load_sock = self.ctx.socket(zmq.PUSH)
            load_sock.connect(self._coordinator_addr)
        encoder = msgspec.msgpack.Encoder()

        def send_outputs(data: bytes) -> None:
            sock.send_multipart([OutputKind.OUTPUTS, data])

        while True:
            item = self.output_queue.get()
            if item is None:
                break
            kind, msg = item
            if kind == OutputKind.OUTPUTS:
                traced_send(crossing.ENGINE_CORE_TO_API, encoder.encode, msg, send=send_outputs)
            elif kind == _LOAD:
                if load_sock is not None:
                    load_sock.send(encoder.encode(msg))
            else:
                sock.send_multipart([kind, encoder.encode(msg)])
        sock.close(linger=1000)
        if load_sock is not None:
            load_sock.close(linger=0)

    # ---- the busy loop ------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        idle = True
        while self.running:
            self._process_input_queue(idle)
            idle = True
            if self.running and self.core.has_unfinished_requests():
                outputs = self.core.step()
                if outputs.outputs:
                    self.output_queue.put((OutputKind.OUTPUTS, outputs))
                self._publish_load()
                # A step that scheduled nothing cannot change until a message arrives: wait for
                # one instead of spinning.
                idle = not self.core.last_step_ran

    def _publish_load(self) -> None:
        """Tell the DP coordinator this rank's queue when a step changed it."""
        if self._coordinator_addr is None:
            return
        s = self.core.scheduler
        load = (len(s.waiting), len(s.running))
        if load != self._last_load:
            self._last_load = load
            self.output_queue.put((_LOAD, RankLoad(self.dp_rank, *load)))

    def _process_input_queue(self, block: bool) -> None:
        """Handle every queued message; with `block`, wait for the first one."""
        while True:
            try:
                kind, msg = self.input_queue.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block:
                    continue  # idle: keep waiting (shutdown arrives as a message)
                return
            block = False
            self._handle(kind, msg)
            if not self.running:
                return

    def _handle(self, kind: bytes, msg: Any) -> None:
        if kind == RequestKind.ADD:
            request, received = msg
            try:
                self.core.add_request(request, queued_time=received)
            except ValueError as e:
                # Validated in the API process already; a duplicate id still must not kill us.
                self.output_queue.put((OutputKind.OUTPUTS, _rejected(request.request_id, str(e))))
        elif kind == RequestKind.ABORT:
            self.core.abort_requests(msg)
            self._publish_load()
        elif kind == RequestKind.UTILITY:
            self.output_queue.put((OutputKind.UTILITY, self._call_utility(msg)))
        elif kind == RequestKind.SHUTDOWN:
            self.running = False

    def _call_utility(self, req: UtilityRequest) -> UtilityResult:
        try:
            if req.method == "get_stats":
                stats = self.core.get_stats()
                stats["trace_spans_dropped"] = dropped_spans()
                return UtilityResult(req.call_id, stats)
            if req.method == "reset_prefix_cache":
                return UtilityResult(req.call_id, self.core.reset_prefix_cache())
            if req.method == "flush_traces":
                return UtilityResult(req.call_id, self.core.flush_traces())
            return UtilityResult(req.call_id, error=f"unknown utility method {req.method!r}")
        except Exception as e:  # a utility call must never take the busy loop down
            return UtilityResult(req.call_id, error=f"{type(e).__name__}: {e}")

    def shutdown(self) -> None:
        self.running = False
        self.output_queue.put(None)
        self._output_thread.join(timeout=5)
        self._input_thread.join(timeout=5)
        self.core.shutdown()
        self.ctx.term()


def _rejected(request_id: str, reason: str) -> EngineCoreOutputs:
    from stepscope.engine.messages import EngineCoreOutput

    return EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason="abort")],
        timestamp=time.time(),
    )


def run_engine_core(
    config: EngineConfig,
    model_dir: Path,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    coordinator_addr: str | None = None,
) -> None:
    """Entry point of the engine-core process (started with the spawn method)."""
    # Ctrl-C in the terminal reaches the whole process group; the client decides on shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM unwinds the main thread through the `finally` below, which stops the workers.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    watch_parent(parent_pid)  # SIGTERM: the same unwinding as a clean stop
    if config.executor == "uni" and config.device == "cpu":
        import torch

        torch.set_num_threads(config.cpu_threads_per_process)  # DP ranks share the cores
    init_process_tracing(
        names.SERVICE_ENGINE_CORE,
        dp_rank=config.data_parallel_rank,
        collector_endpoint=config.collector_endpoint,
        otlp_endpoint=config.otlp_endpoint,
        trace_steps=config.trace_steps,
    )
    ctx = zmq.Context()
    ready_sock = ctx.socket(zmq.PUSH)
    ready_sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        core = EngineCore(config, model_dir)
    except BaseException as e:
        reason = f"engine core failed to start: {type(e).__name__}: {e}"
        ready_sock.send_multipart([OutputKind.DEAD, encoder.encode(EngineDead(reason))])
        ready_sock.close(linger=2000)
        raise
    ready = EngineCoreReady(core.num_kv_blocks, core.max_model_len, core.processes())
    ready_sock.send_multipart([OutputKind.READY, encoder.encode(ready)])
    ready_sock.close(linger=2000)
    ctx.term()
    proc = EngineCoreProc(core, input_addr, output_addr, coordinator_addr)
    try:
        proc.run_busy_loop()
    except Exception as e:
        reason = f"engine core died: {type(e).__name__}: {e}"
        traceback.print_exc()
        proc.output_queue.put((OutputKind.DEAD, EngineDead(reason)))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        proc.shutdown()
        shutdown_tracing()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main() -> None:
    import sys

    args = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoreProcArgs)
    run_engine_core(
        EngineConfig(**args.config),
        Path(args.model_dir),
        args.input_addr,
        args.output_addr,
        args.parent_pid,
        args.coordinator_addr,
    )


if __name__ == "__main__":
    main()
