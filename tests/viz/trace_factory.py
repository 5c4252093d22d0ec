"""A realistic trace for dashboard tests: the real engine core and API-side code, a pretend model.

Four "processes" (API, engine core, workers of rank 0 and 1) record through their own
TracerProvider, each with its `service.name` and rank, the way separate processes would; the
engine's own tracing runs unchanged, reading the provider of the process the calling thread plays
(the workers run side by side in threads, as worker processes would). A real `EngineCore` (its
`Scheduler` and `KVCacheManager`, with a small pool, so requests are chunked, share a prefix and
get preempted) runs every step; its executor is `FakeExecutor`, which crosses to the worker
threads with the same calls as `MultiprocExecutor` and `WorkerProc`, and whose model is a short
sleep, so the timings are real too. The API side is the real `OutputProcessor` and the client's
`encode_request` / `decode_output`; the engine core receives and sends with the calls of
core_proc.py. The spans go into a DuckDB file through `TraceStore`, closed like a finished run.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import msgspec
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.executor.abstract import Executor
from stepscope.engine.frontend.core_client import decode_output, encode_request
from stepscope.engine.frontend.output_processor import OutputProcessor
from stepscope.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    OutputKind,
    SchedulerOutput,
)
from stepscope.engine.models.loader import load_tokenizer, resolve_model
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import crossing, setup
from stepscope.traces import names as n
from stepscope.traces.backend.store import TraceStore
from stepscope.traces.crossing import traced_receive, traced_send
from stepscope.traces.spans import child_span, worker_step_span

BLOCK_SIZE = 16
NUM_BLOCKS = 40
BUDGET = 192
MAX_NUM_SEQS = 8
TP = 2
MODEL = "tiny-llama"


def _providers(exporter: InMemorySpanExporter) -> dict[str, setup.TracingState]:
    kinds = {"api": (n.SERVICE_API, None), "engine_core": (n.SERVICE_ENGINE_CORE, None)}
    kinds.update({f"worker{r}": (n.SERVICE_WORKER, r) for r in range(TP)})
    states = {}
    for key, (service, rank) in kinds.items():
        attributes: dict[str, str | int] = {n.SERVICE_NAME: service}
        if rank is not None:
            attributes[n.RANK] = rank
        provider = TracerProvider(
            resource=Resource.create(attributes),
            sampler=ALWAYS_ON,
            span_limits=setup.SPAN_LIMITS,
            shutdown_on_exit=False,
        )
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        states[key] = setup.TracingState(
            provider, provider.get_tracer("stepscope"), setup.TraceSampling("all")
        )
    return states


class _PerThreadState:
    """Stands in for `setup.state`: each thread records as the process it plays."""

    def __init__(self, states: dict[str, setup.TracingState]) -> None:
        self.states = states
        self.local = threading.local()

    def _current(self) -> setup.TracingState:
        return self.states[getattr(self.local, "key", None) or "engine_core"]

    @property
    def tracer(self):
        return self._current().tracer

    @property
    def sampling(self) -> setup.TraceSampling:
        return self._current().sampling

    @contextmanager
    def process(self, key: str) -> Iterator[None]:
        """Record as process `key`, as if this code ran there."""
        previous = getattr(self.local, "key", None)
        self.local.key = key
        try:
            yield
        finally:
            self.local.key = previous


class _FakeModelRunner:
    """One rank's view of the requests it holds, kept from the SchedulerOutput diffs as a real
    model runner keeps it: a request samples once its prompt (and earlier output) is computed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)  # the same on every rank: all ranks sample alike
        self.num_tokens: dict[str, int] = {}  # prompt + sampled so far
        self.num_computed: dict[str, int] = {}

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in [*out.finished_req_ids, *out.preempted_req_ids]:
            self.num_tokens.pop(rid, None)
            self.num_computed.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        self.num_computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        with child_span(n.PREPARE_INPUTS):
            time.sleep(0.0002)
        with child_span(n.FORWARD):
            time.sleep(0.0008 + out.total_num_scheduled_tokens * 4e-6)
        with child_span(n.SAMPLE):
            sampled = []
            for rid, num in out.num_scheduled_tokens.items():
                self.num_computed[rid] += num
                done = self.num_computed[rid] >= self.num_tokens[rid]
                if done:
                    self.num_tokens[rid] += 1
                sampled.append([self.rng.randrange(1, 49000)] if done else [])
            time.sleep(0.0002)
        return ModelRunnerOutput(list(out.num_scheduled_tokens), sampled)


class FakeExecutor(Executor):
    """TP worker "processes" in threads, reached over the same traced crossings as
    `MultiprocExecutor`: every rank receives each step, rank 0 sends the output back."""

    def __init__(self, state: _PerThreadState, seed: int) -> None:
        self.state = state
        self.pool = ThreadPoolExecutor(TP, thread_name_prefix="worker")
        self.runners = [_FakeModelRunner(seed) for _ in range(TP)]
        self.encoder = msgspec.msgpack.Encoder()
        self.step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self.output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)

    def determine_num_kv_blocks(self) -> int:
        return NUM_BLOCKS

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def worker_configs(self) -> list:
        return []  # its fake runners take no config

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if non_block:  # async scheduling: the step runs now, in order, and its output waits
            output: Future[ModelRunnerOutput] = Future()
            output.set_result(self.execute_model(scheduler_output))
            return output
        start = time.perf_counter()
        futures = []
        traced_send(
            crossing.ENGINE_CORE_TO_WORKER,
            self.encoder.encode,
            scheduler_output,
            send=lambda data: futures.extend(
                self.pool.submit(self._serve, rank, data) for rank in range(TP)
            ),
        )
        payload, worker_seconds = futures[0].result()
        for future in futures[1:]:
            future.result()
        return self.receive_output(
            self.output_decoder.decode, payload, scheduler_output.step, start, worker_seconds
        )

    def _serve(self, rank: int, payload: bytes) -> tuple[bytes | None, float]:
        """One worker's step, as `WorkerProc.execute_model` and `Worker.execute_model` run it."""
        with self.state.process(f"worker{rank}"):
            scheduler_output = traced_receive(
                crossing.ENGINE_CORE_TO_WORKER, self.step_decoder.decode, payload
            )
            start = time.perf_counter()
            reply: list[bytes] = []
            with worker_step_span(scheduler_output.step, rank, scheduler_output.trace_context):
                output = self.runners[rank].execute_model(scheduler_output)
                seconds = time.perf_counter() - start
                if rank == 0:
                    traced_send(
                        crossing.WORKER_TO_ENGINE_CORE,
                        self.encoder.encode,
                        output,
                        step=scheduler_output.step,
                        send=reply.append,
                    )
            return (reply[0] if reply else None), seconds

    def processes(self) -> list[tuple[str, int, int]]:
        return [("worker", rank, os.getpid()) for rank in range(TP)]

    def flush_traces(self) -> None:
        pass  # spans are exported as they end (SimpleSpanProcessor)

    def shutdown(self) -> None:
        self.pool.shutdown()


class _Run:
    def __init__(self, seed: int) -> None:
        self.exporter = InMemorySpanExporter()
        self.state = _PerThreadState(_providers(self.exporter))
        self.rng = random.Random(seed)
        config = EngineConfig.create(
            model=MODEL,
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_BLOCKS,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=NUM_BLOCKS * BLOCK_SIZE,
            enable_prefix_caching=True,
            offline=False,
            executor="mp",  # what it stands for; the executor is given
            tensor_parallel_size=TP,
        )
        model_dir = resolve_model(MODEL)
        self.core = EngineCore(config, model_dir, executor=FakeExecutor(self.state, seed))
        self.outputs = OutputProcessor(load_tokenizer(model_dir), MODEL)
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.encoder = msgspec.msgpack.Encoder()
        self.request_spans: dict[str, object] = {}
        self.shared_prefix = [self.rng.randrange(1, 49000) for _ in range(96)]
        self.steps = 0

    def arrive(self, index: int, prompt_len: int, max_tokens: int, shared: bool) -> None:
        """A request through the API process into the engine core's queue."""
        rid = f"req-{index:02d}"
        prompt = [self.rng.randrange(1, 49000) for _ in range(prompt_len)]
        if shared:
            prompt[: len(self.shared_prefix)] = self.shared_prefix
        params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9)
        with self.state.process("api"):
            request = EngineCoreRequest(rid, prompt, params, None, time.time())
            time.sleep(0.0003 + prompt_len * 2e-6)  # HTTP parsing and tokenizing
            state = self.outputs.add_request(request, operation=n.OPERATION_CHAT, stream=True)
            self.request_spans[rid] = state.span
            with state.span.current():
                data = encode_request(request)
        time.sleep(0.0001)
        received = traced_receive(crossing.API_TO_ENGINE_CORE, self.request_decoder.decode, data)
        self.core.add_request(received, time.time())

    def step(self) -> None:
        """One turn of the engine core's busy loop, then the API process takes its outputs."""
        if not self.core.has_unfinished_requests():
            return
        outputs = self.core.step()
        self.steps += self.core.last_step_ran
        if not outputs.outputs:
            return
        data = traced_send(crossing.ENGINE_CORE_TO_API, self.encoder.encode, outputs)
        with self.state.process("api"):
            received: EngineCoreOutputs = decode_output(OutputKind.OUTPUTS, data)
            processed = self.outputs.process_outputs(received.outputs)
            for out in processed.request_outputs:
                if out.finished:
                    time.sleep(0.0002)  # the last SSE chunk and [DONE]
                    self.request_spans.pop(out.request_id).end()


# (arrival step, prompt tokens, max output tokens, shares the common prefix)
WORKLOAD = [
    (0, 60, 12, False),
    (0, 150, 8, True),
    (1, 300, 10, False),
    (2, 40, 20, False),
    (4, 130, 8, True),  # same 96-token prefix as req-01: a prefix-cache hit
    (5, 220, 6, False),
    (6, 90, 16, False),
    (8, 350, 6, False),
    (10, 25, 24, False),
    (12, 180, 10, True),
    (14, 70, 12, False),
    (18, 260, 8, False),
]


def record_workload(seed: int = 0, max_steps: int = 200) -> tuple[list, dict[str, int]]:
    """Run the workload; returns its spans (SDK `ReadableSpan`s) and what the run did."""
    previous, setup.state = setup.state, None
    run = _Run(seed)
    pending = list(enumerate(WORKLOAD))
    turn = 0
    setup.state = run.state
    try:
        while (pending or run.core.has_unfinished_requests()) and turn < max_steps:
            while pending and pending[0][1][0] <= turn:
                index, (_, prompt_len, max_tokens, shared) = pending.pop(0)
                run.arrive(index, prompt_len, max_tokens, shared)
            run.step()
            turn += 1
    finally:
        setup.state = previous
        run.core.shutdown()
    assert not run.core.has_unfinished_requests(), "the workload did not finish"
    stats = run.core.get_stats()
    info = {
        "steps": run.steps,
        "requests": len(WORKLOAD),
        "preemptions": stats["num_preemptions"],
        "prefix_hits": stats["prefix_hits"],
    }
    return list(run.exporter.get_finished_spans()), info


def write_trace(path: str, seed: int = 0) -> dict[str, int]:
    """Run the workload, write its spans into the DuckDB file `path` (closed after), and say what
    the run did."""
    spans, info = record_workload(seed)
    with TraceStore(path) as store:
        store.insert_spans(spans)
    return info


if __name__ == "__main__":
    import sys

    print(write_trace(sys.argv[1]))
