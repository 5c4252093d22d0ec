"""One OpenTelemetry TracerProvider per process, built after the process starts.

Every process of the request path (API server, engine core, each worker) calls `init_tracing`
once it is running, never inheriting a provider across a fork: a forked child forgets the
parent's provider and records nothing until it calls `init_tracing` itself. Spans leave through
a BatchSpanProcessor to the collector (OTLP/HTTP protobuf), straight into a DuckDB file (in-process
runs), and optionally to any other OTLP endpoint. Spans lost on the way (full queue, failed export)
are counted and logged, never dropped silently; a process that sends to the collector reports its
counts there as it shuts down, so that the run's closing line can say how many were lost.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Tracer

from stepscope.traces import names as n

logger = logging.getLogger(__name__)

# A step span links every request it served; the SDK's default limit of 128 links would cut them.
SPAN_LIMITS = SpanLimits(max_links=4096, max_events=1024, max_span_attributes=128)
MAX_QUEUE_SIZE = 65_536  # spans buffered per exporter: seconds of engine steps at full speed
MAX_EXPORT_BATCH_SIZE = 2048
# Each export costs its sender and the collector a few ms whatever its size; OTel's default is 5 s,
# the live dashboard wants spans within seconds.
SCHEDULE_DELAY_MS = 2000
WARNING_INTERVAL_S = 5.0  # lost spans are counted always, logged at most this often
REPORT_TIMEOUT_S = 5.0


class TraceSampling:
    """Which steps record step, worker-step and crossing spans (`--trace-steps`).

    `all` records every step, `every:N` steps whose index is a multiple of N, `off` none. Request
    spans are always recorded. A span not tied to a step (`step=None`) is recorded unless `off`.
    """

    __slots__ = ("every", "spec")

    def __init__(self, spec: str = "all") -> None:
        spec = spec.strip().lower()
        if spec == "all":
            self.every = 1
        elif spec == "off":
            self.every = 0
        elif spec.startswith("every:") and spec[6:].isdigit() and int(spec[6:]) > 0:
            self.every = int(spec[6:])
        else:
            raise ValueError(
                f"--trace-steps must be 'all', 'every:N' (N >= 1) or 'off', got {spec!r}"
            )
        self.spec = spec

    @property
    def off(self) -> bool:
        return self.every == 0

    @property
    def all(self) -> bool:
        return self.every == 1

    def records(self, step: int | None) -> bool:
        if self.every == 0:
            return False
        return step is None or self.every == 1 or step % self.every == 0

    def __repr__(self) -> str:
        return f"TraceSampling({self.spec!r})"


class CountingSpanExporter(SpanExporter):
    """Wraps an exporter and counts spans it failed to deliver."""

    def __init__(self, inner: SpanExporter, label: str) -> None:
        self.inner = inner
        self.label = label
        self.exported = 0
        self.failed = 0
        self._last_warning = float("-inf")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            logger.exception("tracing: exporter %s raised", self.label)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
            now = time.monotonic()
            if (
                now - self._last_warning > WARNING_INTERVAL_S
            ):  # one line per interval, not per batch
                self._last_warning = now
                logger.warning(
                    "tracing: %d spans lost exporting to %s (%d lost in all)",
                    len(spans),
                    self.label,
                    self.failed,
                )
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _CountingQueue(collections.deque):
    """The batch processor's span queue, counting what a full queue pushes out.

    The SDK's deque has a maxlen and silently drops its oldest span when full. Counting under a
    lock shared with `pop` (the export thread) makes the count exact.
    """

    def __init__(self, maxlen: int) -> None:
        super().__init__((), maxlen)
        self.lock = threading.Lock()
        self.dropped = 0

    def appendleft(self, item: object) -> None:
        with self.lock:
            if len(self) == self.maxlen:
                self.dropped += 1
            super().appendleft(item)

    def pop(self) -> object:
        with self.lock:
            return super().pop()


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor that counts the spans its full queue (or a shutdown) turns away."""

    def __init__(self, exporter: CountingSpanExporter, **kwargs: int) -> None:
        super().__init__(exporter, **kwargs)
        self.counting_exporter = exporter
        self.queue = _CountingQueue(kwargs.get("max_queue_size", MAX_QUEUE_SIZE))
        # Swap in the counting queue (still empty); the SDK reads `_queue` at every use.
        processor = getattr(self, "_batch_processor", None)
        if not isinstance(getattr(processor, "_queue", None), collections.deque):
            raise RuntimeError("this opentelemetry-sdk's BatchSpanProcessor has no span deque")
        processor._queue = self.queue
        self.shutdown_drops = 0
        self.ended = 0
        self._last_warning = float("-inf")

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        self.ended += 1
        before = self.queue.dropped
        closed = self._batch_processor._shutdown
        if closed:
            self.shutdown_drops += 1  # the SDK ignores spans ended after shutdown
        super().on_end(span)
        if closed or self.queue.dropped != before:
            now = time.monotonic()
            if now - self._last_warning > WARNING_INTERVAL_S:
                self._last_warning = now
                logger.warning(
                    "tracing: span queue to %s full or closed, %d spans dropped so far",
                    self.counting_exporter.label,
                    self.queue.dropped + self.shutdown_drops,
                )

    @property
    def dropped(self) -> int:
        return self.queue.dropped + self.shutdown_drops + self.counting_exporter.failed

    def exports_to(self, kind: type[SpanExporter]) -> bool:
        return isinstance(self.counting_exporter.inner, kind)


def _traces_url(endpoint: str) -> str:
    """OTLP/HTTP base URL or full URL -> the traces URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


@dataclass(slots=True)
class TracingState:
    provider: TracerProvider
    tracer: Tracer
    sampling: TraceSampling
    processors: list[CountingBatchSpanProcessor] = field(default_factory=list)
    pid: int = field(default_factory=os.getpid)
    # The collector's base URL and the processor that exports to it: its counts are reported
    # there at shutdown.
    collector_url: str | None = None
    to_collector: CountingBatchSpanProcessor | None = None


# The helpers in `spans` read this on every call: None means tracing is off in this process.
state: TracingState | None = None
_lock = threading.Lock()
_dropped_at_shutdown = 0


def init_tracing(
    service_name: str,
    *,
    rank: int | None = None,
    dp_rank: int | None = None,
    collector_endpoint: str | None = None,
    otlp_endpoint: str | None = None,
    trace_steps: str | TraceSampling = "all",
    exporters: Sequence[SpanExporter] = (),
    export_timeout_s: float = 10.0,
    max_queue_size: int = MAX_QUEUE_SIZE,
    schedule_delay_ms: int = SCHEDULE_DELAY_MS,
) -> TracerProvider:
    """Build this process's TracerProvider and make the `spans` helpers record.

    `service_name` is `stepscope.api`, `stepscope.engine_core` or `stepscope.worker` (with
    `rank`; cores and workers also with their data-parallel `dp_rank`). Spans go to the
    collector (`collector_endpoint`, its base URL), to `otlp_endpoint` (any OTLP/HTTP backend) and
    to extra `exporters` (`traces.backend.store.DuckDBSpanExporter` writes a DuckDB file from
    this process); at least one destination is required.
    Calling it again replaces (and flushes) the previous provider.
    """
    global state
    sampling = trace_steps if isinstance(trace_steps, TraceSampling) else TraceSampling(trace_steps)
    destinations: list[tuple[SpanExporter, str]] = []
    if collector_endpoint or otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    if collector_endpoint:
        url = _traces_url(collector_endpoint)
        destinations.append((OTLPSpanExporter(endpoint=url, timeout=export_timeout_s), url))
    if otlp_endpoint:
        url = _traces_url(otlp_endpoint)
        destinations.append((OTLPSpanExporter(endpoint=url, timeout=export_timeout_s), url))
    destinations.extend((e, type(e).__name__) for e in exporters)
    if not destinations:
        raise ValueError(
            "init_tracing needs somewhere to send spans: collector_endpoint, otlp_endpoint "
            "or exporters"
        )

    attributes: dict[str, str | int] = {
        n.SERVICE_NAME: service_name,
        n.PROCESS_PID: os.getpid(),
        n.OPENINFERENCE_PROJECT_NAME: n.PROJECT_NAME,  # Phoenix files the spans under it
    }
    if rank is not None:
        attributes[n.RANK] = rank
    if dp_rank is not None:
        attributes[n.DP_RANK] = dp_rank
    # Our own atexit hook flushes, and only in the process that built the provider.
    provider = TracerProvider(
        resource=Resource.create(attributes),
        sampler=ALWAYS_ON,
        span_limits=SPAN_LIMITS,
        shutdown_on_exit=False,
    )
    processors = []
    for exporter, label in destinations:
        processor = CountingBatchSpanProcessor(
            CountingSpanExporter(exporter, label),
            max_queue_size=max_queue_size,
            max_export_batch_size=min(MAX_EXPORT_BATCH_SIZE, max_queue_size),
            schedule_delay_millis=schedule_delay_ms,
        )
        provider.add_span_processor(processor)
        processors.append(processor)

    with _lock:
        previous, state = state, None
        if previous is not None:
            _shutdown(previous)
        state = TracingState(
            provider=provider,
            tracer=provider.get_tracer("stepscope"),
            sampling=sampling,
            processors=processors,
            collector_url=collector_endpoint.rstrip("/").removesuffix("/v1/traces")
            if collector_endpoint
            else None,
            to_collector=processors[0] if collector_endpoint else None,
        )
    return provider


def _shutdown(old: TracingState) -> int:
    global _dropped_at_shutdown
    old.provider.shutdown()
    dropped = sum(p.dropped for p in old.processors)
    if dropped:
        logger.warning("tracing: %d spans were dropped in this process", dropped)
    _dropped_at_shutdown = dropped
    if old.collector_url is not None and old.to_collector is not None:
        _report(old, old.collector_url, old.to_collector)
    return dropped


def _report(old: TracingState, url: str, processor: CountingBatchSpanProcessor) -> None:
    """Tell the collector how many spans this process ended and how many of them it lost."""
    resource = old.provider.resource.attributes
    body = json.dumps(
        {
            "pid": old.pid,
            "service": resource.get(n.SERVICE_NAME),
            "ended": processor.ended,
            "lost": processor.dropped,
        }
    ).encode()
    request = urllib.request.Request(
        url + "/report", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=REPORT_TIMEOUT_S):
            pass
    except OSError as error:
        logger.warning(
            "tracing: could not report to the collector at %s (%s): %d of this process's %d "
            "spans were lost on the way",
            url,
            error,
            processor.dropped,
            processor.ended,
        )


def shutdown_tracing() -> int:
    """Flush and close every exporter; the helpers become no-ops. Returns spans dropped."""
    global state
    with _lock:
        old, state = state, None
        if old is None:
            return _dropped_at_shutdown
        return _shutdown(old)


def flush_tracing(timeout_s: float = 30.0) -> bool:
    """Export every span ended so far (the DuckDB file or the collector then has them)."""
    current = state
    return current is None or current.provider.force_flush(int(timeout_s * 1000))


def dropped_spans() -> int:
    """Spans lost so far by this process's provider (or the last one shut down)."""
    current = state
    if current is None:
        return _dropped_at_shutdown
    return sum(p.dropped for p in current.processors)


def get_tracer() -> Tracer | None:
    """The stepscope tracer of this process, or None when tracing is not initialised."""
    current = state
    return None if current is None else current.tracer


def is_enabled() -> bool:
    return state is not None


def _forget_in_child() -> None:
    # A forked child must build its own provider. The parent's is kept referenced but never used
    # or closed here: closing it would flush the parent's spans or checkpoint its DuckDB file.
    global state, _lock
    if state is not None:
        _inherited.append(state)
    state = None
    _lock = threading.Lock()


def _shutdown_at_exit() -> None:
    if state is not None and state.pid == os.getpid():
        shutdown_tracing()


_inherited: list[TracingState] = []
os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_shutdown_at_exit)

__all__ = [
    "CountingBatchSpanProcessor",
    "CountingSpanExporter",
    "TraceSampling",
    "dropped_spans",
    "flush_tracing",
    "get_tracer",
    "init_tracing",
    "is_enabled",
    "shutdown_tracing",
]


def init_process_tracing(
    service_name: str,
    *,
    rank: int | None = None,
    dp_rank: int | None = None,
    collector_endpoint: str | None = None,
    otlp_endpoint: str | None = None,
    trace_steps: str = "all",
    schedule_delay_ms: int = SCHEDULE_DELAY_MS,
) -> bool:
    """`init_tracing` for a process of the engine when it has somewhere to send spans; with no
    destination tracing stays off (every helper a no-op) and this returns False."""
    if not (collector_endpoint or otlp_endpoint):
        return False
    init_tracing(
        service_name,
        rank=rank,
        dp_rank=dp_rank,
        collector_endpoint=collector_endpoint,
        otlp_endpoint=otlp_endpoint,
        trace_steps=trace_steps,
        schedule_delay_ms=schedule_delay_ms,
    )
    return True
