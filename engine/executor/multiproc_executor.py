"""The multi-process executor: one worker process per tensor-parallel rank (stages 5 and 7:
core -> worker -> core, across processes).

Built inside the engine-core process; this is the engine core's side of the sockets. The worker
processes (spawned, each building its own `Worker`; ranks all-reduce over torch.distributed) run
engine/worker/worker_proc.py. Every rank gets every message; only rank 0 returns the
`ModelRunnerOutput`, since all ranks sample the same tokens (identical logits after the
all-reduce, same sampler seed).

Channels (sockets live in a private temp dir; the kinds are in engine/messages.py):
- core -> workers: ZMQ XPUB -> SUB over ipc://, frames [kind, msgpack payload]. Kinds
  (`WorkerRequestKind`): `step` (a SchedulerOutput), `call` (a utility method name and its
  arguments), `stop`.
- workers -> core: ZMQ PUSH -> PULL over ipc://, frames [kind, msgpack (rank, seconds), payload].
  Kinds (`WorkerReplyKind`): `ready`, `output` (rank 0 only; seconds = time inside
  `execute_model`), `result` (every rank answers a utility call), `error` (start-up or step
  exception text; the worker then exits), `beat` (a worker machine's heartbeat).

Why ZMQ and not a shared-memory ring buffer (vLLM's choice on GPUs): measured side by side on this
2-core CPU machine, round trip of a SchedulerOutput out to N worker processes plus a
ModelRunnerOutput back from one (ZMQ PUSH reply in both cases), median of 2000, 1.1-1.7 KB
messages (64 decodes; a 512-token prefill of 4 new requests):

| workers | ZMQ XPUB/SUB | shm ring, readers spin | shm, sched_yield | shm, 50 us sleep |
|---------|--------------|------------------------|------------------|------------------|
| 1       | 57-62 us     | 39-42 us               | 39-41 us         | 132-145 us       |
| 2       | 76-95 us     | 63 us - 8 ms           | 67 us - 4 ms     | 135-151 us       |
| 4       | 119-156 us   | 20-24 ms               | 52-120 us        | 157-183 us       |

(p90 of the shm sched_yield variant: up to 4 ms.) A ring saves ~20 us only while every reader has
a core of its own to spin on; once readers outnumber cores they steal the CPU from the engine core
and from each other and the round trip degrades to milliseconds, and polling with a sleep is
slower than ZMQ. ZMQ blocks in the kernel, costs nothing while idle, and ~0.1 ms is well under 1%
of a CPU step. The XPUB side counts one subscription per worker before the executor is ready, so
no step is sent before every SUB socket can receive it.

`last_crossing_seconds` is the last step's core -> worker -> core time without the forward: the
round trip less rank 0's time inside `execute_model` (so encoding, both socket hops, decoding and
the process wake-ups count; waiting on a peer's all-reduce counts as forward). Not measured for a
step sent with `non_block`, whose round trip also holds the wait behind the step before it.

Async scheduling: `execute_model(..., non_block=True)` sends the step and returns a Future of its
output at once; the workers queue it behind the step they run (their SUB socket keeps the order).
Rank 0's outputs come back in the order sent, so the Future that is asked reads the reply socket
until its own output is there (vLLM: `FutureWrapper`), handing any earlier one to its own Future;
an output that arrives while a utility call waits for its results is handed on the same way.

Failure is explicit: the core waits for replies with zmq.Poller on the PULL socket and on every
worker's process sentinel, so a worker that dies makes the waiting call raise RuntimeError at
once; the other ranks are then terminated and every later call raises. Workers exit by
themselves when the engine-core process dies (they watch their parent pid).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import shutil
import tempfile
import time
import weakref
from collections import deque
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import zmq

from stepscope.engine.config import Endpoints, EngineConfig
from stepscope.engine.executor.abstract import Executor
from stepscope.engine.liveness import EXECUTOR_POLL_S, WORKER_NODE_TIMEOUT_S
from stepscope.engine.messages import (
    WORKER_UTILITY_METHODS,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerReplyKind,
    WorkerRequestKind,
)
from stepscope.engine.models.config import read_model_shape
from stepscope.engine.worker.worker_proc import describe_exit, start_workers, worker_addresses
from stepscope.traces import crossing
from stepscope.traces.crossing import traced_send
from stepscope.traces.run_spans import process_start_span

READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 5.0
# One reply from a worker: (kind, rank, seconds, payload).
Reply = tuple[bytes, int, float, bytes]


class _WorkerGroup:
    """The worker processes, sockets and socket dir: what must be released, and nothing that
    refers back to the executor, so that it can be finalized at interpreter exit."""

    def __init__(self, tmp_dir: str, bcast_addr: str, results_addr: str) -> None:
        self.tmp_dir = tmp_dir
        self.zmq_ctx = zmq.Context()
        self.bcast = self.zmq_ctx.socket(zmq.XPUB)
        self.bcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per worker
        self.bcast.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self.bcast.setsockopt(zmq.LINGER, 0)
        self.bcast.bind(bcast_addr)
        self.results = self.zmq_ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(results_addr)
        self.procs: list[BaseProcess] = []
        self.closed = False

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful and self.procs and all(p.exitcode is None for p in self.procs):
            with contextlib.suppress(zmq.ZMQError):
                self.bcast.send_multipart([WorkerRequestKind.STOP, b""], flags=zmq.NOBLOCK)
            deadline = time.monotonic() + STOP_GRACE_S
            for p in self.procs:
                p.join(max(deadline - time.monotonic(), 0.0))
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)
        self.bcast.close()
        self.results.close()
        self.zmq_ctx.term()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


class _StepOutput(Future):
    """Rank 0's output of one step sent with `non_block`, read off the reply socket when asked
    for: outputs come back in the order the steps were sent."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._executor._wait_for(self)
        return super().result(timeout)


class MultiprocExecutor(Executor):
    def __init__(
        self, config: EngineConfig, model_dir: Path, endpoints: Endpoints | None = None
    ) -> None:
        """One worker process per TP rank of `config`; `endpoints`: where they send spans."""
        p = config.parallel_config
        tp = p.tensor_parallel_size
        read_model_shape(Path(model_dir), tp)  # refuses a TP size that does not divide the heads
        self.world_size = tp
        self.nnodes, self.master_addr, self.master_port = p.nnodes, p.master_addr, p.master_port
        self.ready_timeout = READY_TIMEOUT_S
        self._failure: str | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        # Steps sent whose output has not been read yet, oldest first: (step, sent at, Future);
        # sent at is None for a step sent with non_block.
        self._in_flight: deque[tuple[int, float | None, Future[ModelRunnerOutput]]] = deque()
        tmp_dir = tempfile.mkdtemp(prefix="stepscope-executor-")
        self.addresses = worker_addresses(config, tmp_dir)
        # This machine's ranks (node 0 of `nnodes`); the others start with `serve --headless`.
        self.local_ranks = range(p.tensor_parallel_size_local)
        self.remote_pids: dict[int, int] = {}  # rank -> pid, of workers on other machines
        self._node_beats: dict[int, float] = {}  # node rank -> last heartbeat
        self._group = _WorkerGroup(tmp_dir, self.addresses.bcast, self.addresses.results)
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        self._ready_ns: dict[int, int] = {}
        endpoints = endpoints or Endpoints()
        started_ns = time.time_ns()
        try:
            self._start_workers(config, Path(model_dir), endpoints)
            self._wait_ready()
        except BaseException:
            self._group.shutdown(graceful=False)
            raise
        for rank, proc in zip(self.local_ranks, self._group.procs, strict=True):
            process_start_span(
                endpoints.startup_context, "worker", rank, started_ns, self._ready_ns[rank],
                proc.pid, actor=None if isinstance(proc, BaseProcess) else proc,
                dp_rank=p.data_parallel_rank,
            )  # fmt: skip
        self._poller = zmq.Poller()
        self._poller.register(self._group.results, zmq.POLLIN)
        for p in self._group.procs:
            self._poller.register(p.sentinel, zmq.POLLIN)

    # ---- start-up --------------------------------------------------------------------------------
    def _start_workers(self, config: EngineConfig, model_dir: Path, endpoints: Endpoints) -> None:
        self._group.procs.extend(
            start_workers(
                config,
                endpoints,
                model_dir,
                self.local_ranks,
                self.world_size,
                self.addresses,
                self._group.tmp_dir,
            )  # fmt: skip
        )

    def _wait_ready(self) -> None:
        """Every rank reports ready (or its start-up error) and subscribes to the broadcast."""
        g = self._group
        poller = zmq.Poller()
        poller.register(g.results, zmq.POLLIN)
        poller.register(g.bcast, zmq.POLLIN)
        for p in g.procs:
            poller.register(p.sentinel, zmq.POLLIN)
        ready: set[int] = set()
        subscribed = 0
        deadline = time.monotonic() + self.ready_timeout
        while len(ready) < self.world_size or subscribed < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - ready)
                remote = [r for r in missing if r not in self.local_ranks]
                hint = (
                    f"; ranks {remote} belong to other machines: start `stepscope serve "
                    f"--headless --nnodes {self.nnodes} --node-rank N --master-addr "
                    f"{self.master_addr} --master-port {self.master_port} --tp "
                    f"{self.world_size} ...` there"
                    if remote
                    else ""
                )
                raise RuntimeError(
                    f"workers {missing} did not report ready within {self.ready_timeout:.0f} s"
                    + hint
                )
            events = dict(poller.poll(left * 1000))
            if g.bcast in events:
                if g.bcast.recv()[:1] == b"\x01":
                    subscribed += 1
                continue
            if g.results in events:
                if (reply := self._read_reply(starting=True)) is not None:
                    _, rank, _, payload = reply
                    if rank not in self.local_ranks:
                        self.remote_pids[rank] = msgspec.msgpack.decode(payload)
                    ready.add(rank)
                    self._ready_ns[rank] = time.time_ns()
                continue
            for rank, p in enumerate(g.procs):
                if p.exitcode is not None:
                    raise RuntimeError(
                        f"worker rank {rank} (pid {p.pid}) died during start-up "
                        f"({describe_exit(p.exitcode)})"
                    )

    # ---- Executor --------------------------------------------------------------------------------
    def determine_num_kv_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def init_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("init_kv_cache", num_blocks)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        self._check_usable()
        sent_at = time.perf_counter()
        traced_send(
            crossing.ENGINE_CORE_TO_WORKER,
            self._encoder.encode,
            scheduler_output,
            send=self._broadcast_step,
        )
        output = _StepOutput(self)
        self._in_flight.append((scheduler_output.step, None if non_block else sent_at, output))
        return output if non_block else output.result()

    def worker_configs(self) -> list[EngineConfig]:
        return [msgspec.convert(c, EngineConfig) for c in self.collective_rpc("get_config")]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a utility method of every rank's Worker; results in rank order."""
        if method not in WORKER_UTILITY_METHODS:
            raise ValueError(
                f"method must be one of {sorted(WORKER_UTILITY_METHODS)}, got {method!r}"
            )
        self._check_usable()
        self._broadcast(WorkerRequestKind.CALL, self._encoder.encode((method, list(args))))
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            kind, rank, _, payload = self._recv()
            if kind != WorkerReplyKind.RESULT:
                self._fail(f"expected results of {method}, got {kind!r} from rank {rank}")
            results[rank] = msgspec.msgpack.decode(payload)
        return [results[r] for r in range(self.world_size)]

    def shutdown(self) -> None:
        self._finalizer()

    # ---- reporting -------------------------------------------------------------------------------
    def flush_traces(self) -> None:
        self.collective_rpc("flush_traces")

    def processes(self) -> list[tuple[str, int, int]]:
        """(role, rank, pid) of every worker process (pids of other machines as they said)."""
        local = [
            ("worker", rank, p.pid)
            for rank, p in zip(self.local_ranks, self._group.procs, strict=True)
        ]
        return local + [("worker", rank, pid) for rank, pid in sorted(self.remote_pids.items())]

    def check_health(self) -> None:
        """Raise RuntimeError if the executor failed or a worker has died; never blocks. Between
        steps this is also where other machines' heartbeats are read."""
        self._check_usable()
        while self._group.results.poll(0):
            self._read_reply()
        self._check_nodes()
        for rank, p in enumerate(self._group.procs):
            if p.exitcode is not None:
                self._fail(self._death_message(rank, p))

    # ---- plumbing --------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"executor failed earlier: {self._failure}")
        if not self._finalizer.alive:
            raise RuntimeError("executor is shut down")

    def _broadcast(self, kind: bytes, payload: bytes) -> None:
        self._group.bcast.send_multipart([kind, payload])

    def _broadcast_step(self, payload: bytes) -> None:
        self._broadcast(WorkerRequestKind.STEP, payload)

    def _read_reply(self, starting: bool = False) -> Reply | None:
        """One message off the reply socket (one is there): a worker machine's heartbeat is
        noted and a step's output handed to its Future (None for both), a worker's error raises
        (`starting`: as a start-up failure)."""
        kind, header, payload = self._group.results.recv_multipart()
        rank, seconds = msgspec.msgpack.decode(header)
        if kind == WorkerReplyKind.HEARTBEAT:
            self._node_beats[rank] = time.monotonic()
            return None
        if kind == WorkerReplyKind.OUTPUT and not starting:
            if not self._in_flight:
                self._fail(f"rank {rank} sent a step output, but no step is running")
            step, sent_at, output = self._in_flight.popleft()
            decode = self._output_decoder.decode
            output.set_result(self.receive_output(decode, payload, step, sent_at, seconds))
            return None
        if kind == WorkerReplyKind.ERROR:
            text = payload.decode(errors="replace")
            if starting:
                raise RuntimeError(
                    f"worker rank {rank} ({self._where(rank)}) failed to start:\n{text}"
                )
            self._fail_from_error(rank, text)
        return kind, rank, seconds, payload

    def _recv(self) -> Reply:
        """Next reply from any rank other than a step output (that goes to its Future) or a
        heartbeat; a worker error or death raises instead of hanging."""
        while (reply := self._next_reply()) is None:
            pass
        return reply

    def _wait_for(self, output: Future[ModelRunnerOutput]) -> None:
        """Read replies until this step's output is in."""
        while not output.done():
            self._check_usable()
            if (reply := self._next_reply()) is not None:
                kind, rank, _, _ = reply
                self._fail(f"expected a step output from rank 0, got {kind!r} from rank {rank}")

    def _next_reply(self) -> Reply | None:
        """Wait for one message on the reply socket and read it (`_read_reply`)."""
        g = self._group
        while True:
            events = dict(self._poller.poll(int(EXECUTOR_POLL_S * 1000)))
            self._check_nodes()
            if g.results in events:
                return self._read_reply()
            for rank, p in enumerate(g.procs):
                if p.sentinel in events or p.exitcode is not None:
                    # The sentinel fires as the process closes its files, a moment before the
                    # kernel can report its exit status.
                    p.join(1.0)
                    self._fail(self._death_message(rank, p))

    def _check_nodes(self) -> None:
        """Workers on other machines: their node's heartbeat must keep coming."""
        now = time.monotonic()
        for node, beat in self._node_beats.items():
            if now - beat > WORKER_NODE_TIMEOUT_S:
                self._fail(
                    f"node {node} (workers on another machine) sent no heartbeat for "
                    f"{WORKER_NODE_TIMEOUT_S:.0f} s: its machine or its `stepscope serve "
                    "--headless` is gone; this executor can no longer run steps"
                )

    def _where(self, rank: int) -> str:
        if rank in self.local_ranks:
            return f"pid {self._group.procs[rank].pid}"
        return f"on node {rank // len(self.local_ranks)}"

    def _death_message(self, rank: int, p: BaseProcess) -> str:
        how = describe_exit(p.exitcode)
        if getattr(p, "death", None):  # a Ray actor: what Ray said
            how = f"{how}: {p.death}"  # type: ignore[attr-defined]
        return (
            f"worker rank {rank} (pid {p.pid}) died ({how}); "
            f"the other workers were stopped and this executor can no longer run steps"
        )

    def _fail_from_error(self, rank: int, text: str) -> None:
        # An error on one rank is often the echo of a peer's death (a broken all-reduce): name
        # the dead peer first when there is one.
        others = [p for r, p in enumerate(self._group.procs) if r != rank]
        ended = multiprocessing.connection.wait([p.sentinel for p in others], timeout=0.5)
        for r, p in enumerate(self._group.procs):
            if r == rank or p.sentinel not in ended:
                continue
            p.join(1.0)
            if p.exitcode is not None and p.exitcode < 0:
                self._fail(f"{self._death_message(r, p)}; rank {rank} then failed:\n{text}")
        self._fail(f"worker rank {rank} ({self._where(rank)}) failed:\n{text}")

    def _fail(self, message: str) -> None:
        self._failure = message
        self._group.shutdown(graceful=False)
        raise RuntimeError(message)
