"""The engine-core process: a busy loop that only schedules, executes and updates (stages 3-8).

Two IO threads bridge the ZMQ sockets and two queues, so the loop never touches a socket:
the input thread decodes requests (ADD, ABORT, UTILITY) onto the input queue, the output thread
encodes EngineCoreOutputs off the output queue. Each turn the loop drains the input queue, then
runs one step if any request is unfinished (or, with async scheduling, a step is still in flight);
with nothing to do it blocks on the input queue.

Start-up is a handshake with whoever launched the core (vLLM: `EngineCoreProc.startup_handshake`):
the core builds its model and KV pool, listens for requests (an ipc path, or a TCP port when
the API servers are on another machine), and tells the launcher READY with that address; the
launcher answers with `CoreAddresses`: one output address per API server, and the DP
coordinator's. Every API server connects to the core's input; each request names its API
server (`client_index`), and its outputs go back to that one only.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import zmq

from stepscope.engine.config import Endpoints, EngineConfig, init_engine_process_tracing
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.liveness import (
    DP_RANK_REPORT_S,
    HEAD_TIMEOUT_S,
    HEAD_WATCH_POLL_S,
    IDLE_HEALTH_CHECK_S,
)
from stepscope.engine.messages import (
    ENGINE_CORE_UTILITY_METHODS,
    CoreAddresses,
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
    call_utility,
)
from stepscope.traces import crossing, names
from stepscope.traces.crossing import traced_receive, traced_send
from stepscope.traces.process import (
    exit_once_on,
    ignore_terminal_signals,
    terminate_self,
    watch_parent,
)
from stepscope.traces.setup import shutdown_tracing

_LOAD = b"load"  # output-queue item for the DP coordinator's socket, not an API server's
_GRAMMAR_COMPILED = b"grammar"  # input-queue item: a grammar compiled, wake the busy loop
HANDSHAKE_TIMEOUT_S = 60.0


class EngineCoreProc:
    def __init__(
        self,
        engine_core: EngineCore,
        input_sock: zmq.Socket,
        ctx: zmq.Context,
        addresses: CoreAddresses,
    ) -> None:
        self.core = engine_core
        self.dp_rank = engine_core.config.parallel_config.data_parallel_rank
        self._rank_frame = str(self.dp_rank).encode()
        self._coordinator_addr = addresses.coordinator_addr
        self._last_load = RankLoad(self.dp_rank, 0, 0)
        self._num_clients = len(addresses.output_addrs)
        self._client_of: dict[str, int] = {}  # request id -> API server, while it runs
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[bytes, int, Any] | None] = queue.Queue()
        # An idle busy loop waits on its input queue, never on a compile: a compiled grammar
        # wakes it like a message would, and the requests waiting on it are scheduled.
        engine_core.wait_for_grammars = False
        engine_core.structured_output_manager.on_compiled = lambda: self.input_queue.put(
            (_GRAMMAR_COMPILED, None)
        )
        self.ctx = ctx
        self.running = True
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(input_sock,), name="core-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_loop,
            args=(addresses.output_addrs,),
            name="core-output",
            daemon=True,
        )
        self._output_thread.start()
        self._input_thread.start()
        if addresses.head_addr is not None:
            threading.Thread(
                target=self._watch_head, args=(addresses.head_addr,), name="head-watch", daemon=True
            ).start()

    # ---- IO threads ---------------------------------------------------------------------------
    def _input_loop(self, sock: zmq.Socket) -> None:
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

    def _watch_head(self, addr: str) -> None:
        """Stop this core when the head's coordinator falls silent (a head that dies hard
        cannot send SHUTDOWN): otherwise it would wait, idle, for requests that never come."""
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(addr)
        heard = time.monotonic()
        while self.running:
            if sock.poll(int(HEAD_WATCH_POLL_S * 1000)):
                while sock.poll(0):
                    sock.recv()
                heard = time.monotonic()
            elif time.monotonic() - heard > HEAD_TIMEOUT_S:
                print(
                    f"stepscope: engine core of DP rank {self.dp_rank}: no word from the head "
                    f"({addr}) for {HEAD_TIMEOUT_S:.0f} s: stopping",
                    file=sys.stderr,
                    flush=True,
                )
                terminate_self()
                break
        sock.close(linger=0)

    def _output_loop(self, output_addrs: list[str]) -> None:
        socks = []
        for addr in output_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(addr)
            socks.append(sock)
        load_sock = None
        if self._coordinator_addr is not None:
            load_sock = self.ctx.socket(zmq.PUSH)
            load_sock.connect(self._coordinator_addr)
        encoder = msgspec.msgpack.Encoder()
        rank = self._rank_frame
        load_sent = time.monotonic()
        while True:
            try:
                item = self.output_queue.get(timeout=DP_RANK_REPORT_S)
            except queue.Empty:
                item = ()
            # The heartbeat goes out on time whether outputs flow or not.
            if load_sock is not None and time.monotonic() - load_sent >= DP_RANK_REPORT_S:
                load_sock.send(encoder.encode(self._last_load))
                load_sent = time.monotonic()
            if item is None:
                break
            if not item:
                continue
            kind, client, msg = item
            if kind == OutputKind.OUTPUTS:
                sock = socks[client]
                traced_send(
                    crossing.ENGINE_CORE_TO_API,
                    encoder.encode,
                    msg,
                    send=lambda data, sock=sock: sock.send_multipart(
                        [OutputKind.OUTPUTS, rank, data]
                    ),
                )
            elif kind == _LOAD:
                if load_sock is not None:
                    load_sock.send(encoder.encode(msg))
                    load_sent = time.monotonic()
            elif kind == OutputKind.DEAD:  # every API server must hear it
                for sock in socks:
                    sock.send_multipart([kind, rank, encoder.encode(msg)])
            else:
                socks[client].send_multipart([kind, rank, encoder.encode(msg)])
        for sock in socks:
            sock.close(linger=1000)
        if load_sock is not None:
            load_sock.close(linger=0)

    # ---- the busy loop ------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        idle = True
        while self.running:
            self._process_input_queue(idle)
            idle = True
            # A step still in flight is collected even when every request has finished.
            if self.running and (self.core.has_unfinished_requests() or self.core.batch_queue):
                outputs = self.core.step()
                if outputs.outputs:
                    self._send_outputs(outputs)
                self._publish_load()
                # A step that scheduled nothing cannot change until a message arrives: wait for
                # one instead of spinning.
                idle = not self.core.last_step_ran

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Each API server gets its own requests' outputs."""
        if self._num_clients == 1:
            self.output_queue.put((OutputKind.OUTPUTS, 0, outputs))
            return
        split: dict[int, list] = {}
        for out in outputs.outputs:
            if out.finish_reason is None:
                client = self._client_of.get(out.request_id, 0)
            else:
                client = self._client_of.pop(out.request_id, 0)
            split.setdefault(client, []).append(out)
        for client, outs in split.items():
            self.output_queue.put(
                (OutputKind.OUTPUTS, client, EngineCoreOutputs(outs, outputs.timestamp))
            )

    def _publish_load(self) -> None:
        """Tell the DP coordinator this rank's queue when a step changed it."""
        if self._coordinator_addr is None:
            return
        s = self.core.scheduler
        load = RankLoad(self.dp_rank, len(s.waiting), len(s.running))
        if load != self._last_load:
            self._last_load = load
            self.output_queue.put((_LOAD, 0, load))

    def _process_input_queue(self, block: bool) -> None:
        """Handle every queued message; with `block`, wait for the first one."""
        while True:
            try:
                kind, msg = self.input_queue.get(
                    block=block, timeout=IDLE_HEALTH_CHECK_S if block else None
                )
            except queue.Empty:
                if block:
                    # Idle: keep waiting (shutdown arrives as a message), but notice a worker
                    # that died meanwhile (this raises, and the loop ends as on a failed step).
                    self.core.executor.check_health()
                    continue
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
            except ValueError:
                # Validated in the API process already; a duplicate id still must not kill us.
                self.output_queue.put(
                    (OutputKind.OUTPUTS, request.client_index, _rejected(request.request_id))
                )
            else:
                if self._num_clients > 1:
                    self._client_of[request.request_id] = request.client_index
        elif kind == RequestKind.ABORT:
            self.core.abort_requests(msg)
            for rid in msg:
                self._client_of.pop(rid, None)
            self._publish_load()
        elif kind == RequestKind.UTILITY:
            self.output_queue.put((OutputKind.UTILITY, msg.client_index, self._call_utility(msg)))
        elif kind == RequestKind.SHUTDOWN:
            self.running = False

    def _call_utility(self, req: UtilityRequest) -> UtilityResult:
        try:
            result = call_utility(self.core, ENGINE_CORE_UTILITY_METHODS, req.method, req.args)
            return UtilityResult(req.call_id, result)
        except Exception as e:  # a utility call must never take the busy loop down
            return UtilityResult(req.call_id, error=f"{type(e).__name__}: {e}")

    def shutdown(self) -> None:
        self.running = False
        self.output_queue.put(None)
        self._output_thread.join(timeout=5)
        self._input_thread.join(timeout=5)
        self.core.shutdown()
        self.ctx.term()


def _rejected(request_id: str) -> EngineCoreOutputs:
    from stepscope.engine.messages import EngineCoreOutput

    return EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason="abort")],
        timestamp=time.time(),
    )


def bind_input(ctx: zmq.Context, bind: str) -> tuple[zmq.Socket, str]:
    """The core's request socket, and the address API servers connect to ("tcp://HOST:*" takes
    any free port)."""
    sock = ctx.socket(zmq.PULL)
    sock.bind(bind)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def handshake(
    ctx: zmq.Context, handshake_addr: str, dp_rank: int, ready: EngineCoreReady | EngineDead
) -> CoreAddresses | None:
    """Tell the launcher READY (or DEAD); wait for its CoreAddresses (None after DEAD)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(handshake_addr)
    rank = str(dp_rank).encode()
    try:
        if isinstance(ready, EngineDead):
            sock.send_multipart([OutputKind.DEAD, rank, msgspec.msgpack.encode(ready)])
            return None
        sock.send_multipart([OutputKind.READY, rank, msgspec.msgpack.encode(ready)])
        if not sock.poll(int(HANDSHAKE_TIMEOUT_S * 1000)):
            raise TimeoutError(
                f"the launcher at {handshake_addr} did not answer the engine core's handshake "
                f"within {HANDSHAKE_TIMEOUT_S:.0f} s"
            )
        return msgspec.msgpack.decode(sock.recv(), type=CoreAddresses)
    finally:
        sock.close(linger=2000)


def run_engine_core(
    config: EngineConfig,
    endpoints: Endpoints,
    model_dir: Path,
    handshake_addr: str,
    input_bind: str,
    parent_pid: int | None,
) -> None:
    """Entry point of the engine-core process (or Ray actor: no `parent_pid`, as Ray stops
    an actor whose launcher is gone)."""
    # Ctrl-C or a hang-up in the terminal reaches the whole process group; the launcher
    # decides on shutdown.
    ignore_terminal_signals()
    # SIGTERM unwinds the main thread through the `finally` below, which stops the workers.
    exit_once_on(signal.SIGTERM)
    if parent_pid is not None:
        watch_parent(parent_pid)  # SIGTERM: the same unwinding as a clean stop
    m, p = config.model_config, config.parallel_config
    if m.device.startswith("cuda") and p.data_parallel_rank_local:
        # Each DP rank on this machine takes its own TP-size run of GPUs.
        import msgspec
        import torch

        base = torch.device(m.device).index or 0
        first = base + p.data_parallel_rank_local * p.tensor_parallel_size
        config = config.replace(model_config=msgspec.structs.replace(m, device=f"cuda:{first}"))
    if p.executor == "uni" and m.device == "cpu":
        import torch

        torch.set_num_threads(p.cpu_threads_per_process)  # DP ranks share the cores
    dp_rank = p.data_parallel_rank
    init_engine_process_tracing(names.SERVICE_ENGINE_CORE, config, endpoints, dp_rank=dp_rank)
    ctx = zmq.Context()
    try:
        core = EngineCore(config, model_dir, endpoints=endpoints)
    except BaseException as e:
        reason = f"failed to start: {type(e).__name__}: {e}"
        handshake(ctx, handshake_addr, dp_rank, EngineDead(reason))
        raise
    input_sock, input_addr = bind_input(ctx, input_bind)
    ready = EngineCoreReady(
        core.num_kv_blocks,
        core.max_model_len,
        core.processes(),
        dp_rank,
        input_addr,
    )
    addresses = handshake(ctx, handshake_addr, dp_rank, ready)
    assert addresses is not None
    proc = EngineCoreProc(core, input_sock, ctx, addresses)
    try:
        proc.run_busy_loop()
    except Exception as e:
        reason = f"died: {type(e).__name__}: {e}"
        traceback.print_exc()
        proc.output_queue.put((OutputKind.DEAD, 0, EngineDead(reason)))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing cuts the stop and flush short
        proc.shutdown()
        shutdown_tracing()


def main() -> None:
    args = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoreProcArgs)
    run_engine_core(
        args.config,
        args.endpoints,
        Path(args.model_dir),
        args.handshake_addr,
        args.input_bind,
        args.parent_pid,
    )


if __name__ == "__main__":
    main()
