"""A realistic trace for dashboard tests: the real scheduler, a pretend model, real span helpers.

Four "processes" (API, engine core, workers of rank 0 and 1) record through their own
TracerProvider, each with its `service.name` and rank, the way separate processes would; the
helpers of `stepscope.traces.spans` run unchanged, reading the provider of the process the calling
thread plays (the workers run side by side in threads, as worker processes would). The
real `Scheduler` and `KVCacheManager` decide every step (a small pool, so requests are chunked,
share a prefix and get preempted); the model is a short sleep, so the timings are real too. The
spans go into a DuckDB file through `TraceStore`, which is then closed like a finished run.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import msgspec
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from stepscope.engine.core.kv_cache_manager import KVCacheManager
from stepscope.engine.core.request import Request
from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names as n
from stepscope.traces import setup
from stepscope.traces import spans as sp
from stepscope.traces.backend.store import TraceStore

BLOCK_SIZE = 16
NUM_BLOCKS = 40
BUDGET = 192
MAX_NUM_SEQS = 8
TP = 2
MODEL = "tiny-llama"
_encode = msgspec.msgpack.Encoder().encode


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
        return self.states[getattr(self.local, "key", "engine_core")]

    @property
    def tracer(self):
        return self._current().tracer

    @property
    def sampling(self) -> setup.TraceSampling:
        return self._current().sampling


class _Run:
    def __init__(self, seed: int) -> None:
        self.exporter = InMemorySpanExporter()
        self.state = _PerThreadState(_providers(self.exporter))
        self.workers = ThreadPoolExecutor(TP, thread_name_prefix="worker")
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
        self.scheduler = Scheduler(self.kv, BUDGET, MAX_NUM_SEQS, max_model_len=4096)
        self.request_spans: dict[str, object] = {}
        self.links: dict[str, object] = {}
        self.shared_prefix = [self.rng.randrange(1, 49000) for _ in range(96)]

    @contextmanager
    def process(self, key: str) -> Iterator[None]:
        """Record as process `key`, as if this code ran there."""
        previous = getattr(self.state.local, "key", None)
        self.state.local.key = key
        try:
            yield
        finally:
            self.state.local.key = previous

    def arrive(self, index: int, prompt_len: int, max_tokens: int, shared: bool) -> None:
        rid = f"req-{index:02d}"
        prompt = [self.rng.randrange(1, 49000) for _ in range(prompt_len)]
        if shared:
            prompt[: len(self.shared_prefix)] = self.shared_prefix
        params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9)
        with self.process("api"):
            request = sp.request_span(
                rid,
                model=MODEL,
                max_tokens=max_tokens,
                temperature=0.7,
                top_p=0.9,
                input_tokens=prompt_len,
            )
            self.request_spans[rid] = request
            time.sleep(0.0003 + prompt_len * 2e-6)  # HTTP parsing and tokenizing
            with request.current():
                crossing, carrier = sp.send_span(n.API_TO_ENGINE_CORE, "EngineCoreRequest", None, 1)
                with crossing:
                    message = EngineCoreRequest(rid, prompt, params, None, time.time(), carrier)
                    data = _encode(message)
                    crossing.set_nbytes(len(data))
        t0 = time.time_ns()
        time.sleep(0.0001)
        with (
            self.process("engine_core"),
            sp.receive_span(
                n.API_TO_ENGINE_CORE, "EngineCoreRequest", len(data), 1, carrier, start_ns=t0
            ),
        ):
            self.links[rid] = sp.request_link(carrier)
            self.scheduler.add_request(
                Request(rid, prompt, params, None, BLOCK_SIZE, arrival_time=time.time())
            )

    def _worker(self, rank: int, output: SchedulerOutput, carrier: dict, nbytes: int):
        num_reqs = len(output.num_scheduled_tokens)
        back_carrier: dict[str, str] = {}
        t0 = time.time_ns()
        with self.process(f"worker{rank}"):
            with sp.receive_span(
                n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", nbytes, num_reqs, carrier, start_ns=t0
            ):
                time.sleep(0.00005)
            with sp.worker_step_span(output.step, rank, carrier):
                with sp.child_span(n.PREPARE_INPUTS):
                    time.sleep(0.0002)
                with sp.child_span(n.FORWARD):
                    time.sleep(0.0008 + output.total_num_scheduled_tokens * 4e-6)
                with sp.child_span(n.SAMPLE):
                    time.sleep(0.0002)
                if rank == 0:
                    sampled = []
                    for rid in output.num_scheduled_tokens:
                        r = self.scheduler.requests[rid]
                        done = r.num_computed_tokens >= r.num_tokens
                        sampled.append([self.rng.randrange(1, 49000)] if done else [])
                    result = ModelRunnerOutput(list(output.num_scheduled_tokens), sampled)
                    back, back_carrier = sp.send_span(
                        n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", None, num_reqs
                    )
                    with back:
                        result.trace_context = back_carrier
                        back.set_nbytes(len(_encode(result)))
                    return result, back_carrier
        return None, back_carrier

    def step(self) -> None:
        scheduler = self.scheduler
        with self.process("engine_core"):
            with sp.step_span(step=scheduler.step_index) as span:
                with sp.child_span(n.SCHEDULE):
                    output = scheduler.schedule()
                    time.sleep(0.0001)
                span.record(
                    scheduler.last_stats,
                    output.num_scheduled_tokens,
                    links=self.links,
                    kv_total_blocks=NUM_BLOCKS,
                )
                if not output.total_num_scheduled_tokens:
                    return
                num_reqs = len(output.num_scheduled_tokens)
                with sp.child_span(n.EXECUTE):
                    crossing, carrier = sp.send_span(
                        n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", None, num_reqs
                    )
                    with crossing:
                        output.trace_context = carrier
                        nbytes = len(_encode(output))
                        crossing.set_nbytes(nbytes)
                    futures = [
                        self.workers.submit(self._worker, r, output, carrier, nbytes)
                        for r in range(TP)
                    ]
                    result, back_carrier = futures[0].result()
                    for future in futures[1:]:
                        future.result()
                    with sp.receive_span(
                        n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", 200, num_reqs, back_carrier
                    ):
                        pass
                with sp.child_span(n.UPDATE):
                    outputs = scheduler.update_from_output(output, result)
            finished = {o.request_id for o in outputs if o.finish_reason is not None}
            for rid in finished:
                self.links.pop(rid, None)
            if not outputs:
                return
            ids = [o.request_id for o in outputs]
            crossing, carrier = sp.send_span(
                n.ENGINE_CORE_TO_API,
                "EngineCoreOutputs",
                None,
                len(outputs),
                step=output.step,
                request_ids=ids,
            )
            with crossing:
                data = _encode(EngineCoreOutputs(outputs, time.time(), carrier))
                crossing.set_nbytes(len(data))
        t0 = time.time_ns()
        with self.process("api"):
            with sp.receive_span(
                n.ENGINE_CORE_TO_API,
                "EngineCoreOutputs",
                len(data),
                len(outputs),
                carrier,
                start_ns=t0,
            ):
                pass
            for out in outputs:
                request = self.request_spans[out.request_id]
                request.observe(out)
                time.sleep(0.00003 * len(out.new_token_ids))  # incremental detokenizer
                if out.finish_reason is not None:
                    time.sleep(0.0002)  # the last SSE chunk and [DONE]
                    request.end()


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
    run = _Run(seed)
    pending = list(enumerate(WORKLOAD))
    step = 0
    previous, setup.state = setup.state, run.state
    try:
        while (pending or run.scheduler.has_unfinished_requests()) and step < max_steps:
            while pending and pending[0][1][0] <= step:
                index, (_, prompt_len, max_tokens, shared) = pending.pop(0)
                run.arrive(index, prompt_len, max_tokens, shared)
            run.step()
            step += 1
    finally:
        setup.state = previous
        run.workers.shutdown()
    assert not run.scheduler.has_unfinished_requests(), "the workload did not finish"
    info = {
        "steps": step,
        "requests": len(WORKLOAD),
        "preemptions": run.scheduler.num_preemptions,
        "prefix_hits": run.kv.prefix_hits,
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
