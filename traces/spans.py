"""The helpers the engine calls to record spans: one line each at every stage and boundary.

    with step_span(step=scheduler.step_index) as step:          # engine core, every step
        with child_span(names.SCHEDULE):
            out = scheduler.schedule()
        step.record(scheduler.last_stats, out.num_scheduled_tokens, links=request_links)
        runner_output = executor.execute_model(out)  # traced_send / traced_receive inside

Messages over the four boundaries go through `crossing.traced_send` / `traced_receive`, built on
`send_span` and `receive_span` (traces/crossing_spans.py); the spans of a run as a whole (its
configuration, its engine's start) are in traces/run_spans.py.

Every helper returns the shared `NOOP` object when tracing is not initialised in this process
(or the step is not sampled), so the engine pays one attribute lookup per call. Which steps record
is `TraceSampling` (`--trace-steps`): request spans always record; step, worker-step and crossing
spans follow the step; a receiving process follows the sender's decision carried in the context.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from time import process_time_ns
from types import MappingProxyType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stepscope.traces import names as n
from stepscope.traces import setup as _setup

_PROPAGATOR = TraceContextTextMapPropagator()
# OpenInference's span kind, set as every span starts (read-only: the SDK copies attributes).
_CHAIN = MappingProxyType({n.OPENINFERENCE_SPAN_KIND: n.SPAN_KIND_CHAIN})
_LLM = MappingProxyType({n.OPENINFERENCE_SPAN_KIND: n.SPAN_KIND_LLM})


# ---- context propagation ------------------------------------------------------------------------
def inject_context(ctx: Context | None = None) -> dict[str, str]:
    """The W3C trace context (`traceparent`, `tracestate`) of `ctx` (default: current) as a dict."""
    carrier: dict[str, str] = {}
    if _setup.state is not None:
        _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def extract_context(carrier: Mapping[str, str] | None) -> Context:
    """The context a carrier holds; an empty context (a new root) when it holds none."""
    return _PROPAGATOR.extract(carrier) if carrier else Context()


def request_link(carrier: Mapping[str, str] | None) -> SpanContext | None:
    """The request span a message from the API refers to, for the engine core's step links."""
    if not carrier or _setup.state is None:
        return None
    own = carrier.get(n.CARRIER_REQUEST)
    if own:
        trace_hex, _, span_hex = own.partition("-")
        try:
            return SpanContext(
                int(trace_hex, 16), int(span_hex, 16), is_remote=True, trace_flags=TraceFlags(1)
            )
        except ValueError:
            pass  # malformed: fall back to the traceparent
    span_context = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


# ---- span scopes ---------------------------------------------------------------------------------
class _Noop:
    """Stands in for every scope when nothing is recorded: all methods do nothing."""

    __slots__ = ()
    span = None
    recording = False

    @property
    def carrier(self) -> dict[str, str]:
        return {}

    def __enter__(self) -> _Noop:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    set_attribute = record = set_nbytes = event = add_events = observe = finish = end = _nothing
    record_prompt = _nothing

    def current(self) -> _Noop:
        return self

    def attached(self) -> _Noop:
        return self


NOOP = _Noop()


class _Scope:
    """A started span; `with` makes it current and ends it (recording any exception)."""

    __slots__ = ("_token", "span")
    recording = True

    def __init__(self, span: Span) -> None:
        self.span = span
        self._token: object | None = None

    def __enter__(self) -> Any:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any):
        if exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None
        self.end()

    def end(self) -> None:
        self.span.end()

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    @contextmanager
    def attached(self) -> Iterator[Any]:
        """Current for the block, and left open after it, for a later `with` on it to end (a
        step that runs on while the engine core does other work). A block that raises ends it
        at once, with the error: nothing would end it later."""
        token = otel_context.attach(trace.set_span_in_context(self.span))
        try:
            yield self
        except BaseException as exc:
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            self.end()
            raise
        finally:
            otel_context.detach(token)


class StepSpan(_Scope):
    """`stepscope.engine_step`: what the scheduler decided this step and whom it served."""

    __slots__ = ()

    def record(
        self,
        stats: Any,
        request_ids: Sequence[str] | Mapping[str, int] = (),
        request_num_tokens: Sequence[int] | None = None,
        links: Mapping[str, SpanContext | None] | Iterable[SpanContext | Link | None] = (),
        *,
        kv_total_blocks: int | None = None,
    ) -> None:
        """Set the step's attributes from a `StepStats` and the requests it served.

        `request_ids` may be the SchedulerOutput's `num_scheduled_tokens` mapping (id -> tokens);
        `links` the request span contexts, either by request id or as a plain list.
        """
        if isinstance(request_ids, Mapping):
            ids = list(request_ids)
            num_tokens = list(request_ids.values()) if request_num_tokens is None else None
        else:
            ids = list(request_ids)
            num_tokens = None
        if num_tokens is None:
            num_tokens = list(request_num_tokens or ())
        if len(num_tokens) != len(ids):
            raise ValueError(
                f"request_num_tokens must parallel request_ids: {len(num_tokens)} != {len(ids)}"
            )
        if kv_total_blocks is None:
            kv_total_blocks = getattr(stats, "kv_total_blocks", None)
        attributes: dict[str, Any] = {
            n.STEP: stats.step,
            n.NUM_RUNNING: stats.num_running,
            n.NUM_WAITING: stats.num_waiting,
            n.NUM_DECODE_TOKENS: stats.num_decode_tokens,
            n.NUM_PREFILL_TOKENS: stats.num_prefill_tokens,
            n.TOKEN_BUDGET: stats.token_budget,
            n.KV_FREE_BEFORE: stats.kv_free_before,
            n.KV_FREE_AFTER: stats.kv_free_after,
            n.PREFIX_HIT_TOKENS: stats.prefix_hit_tokens,
            n.PREEMPTED_IDS: list(stats.preempted),
            n.FINISHED_IDS: list(stats.finished),
            n.REQUEST_IDS: ids,
            n.REQUEST_NUM_TOKENS: num_tokens,
        }
        if kv_total_blocks is not None:
            attributes[n.KV_TOTAL_BLOCKS] = kv_total_blocks
        context = getattr(stats, "num_context_tokens", None)
        if context is not None:
            attributes[n.NUM_CONTEXT_TOKENS] = context
        by_group = getattr(stats, "kv_blocks_by_group", ())
        if by_group:
            attributes[n.KV_BLOCKS_BY_GROUP] = list(by_group)
            windows = getattr(stats, "kv_group_windows", ())
            if len(windows) == len(by_group):
                attributes[n.KV_GROUP_WINDOWS] = list(windows)
        reason = getattr(stats, "waiting_reason", None)
        if reason is not None:
            attributes[n.WAITING_REASON] = reason
            attributes[n.WAITING_REASON_COUNT] = stats.num_waiting
            if stats.kv_blocks_short:
                attributes[n.KV_BLOCKS_SHORT] = stats.kv_blocks_short
        self.span.set_attributes(attributes)
        if isinstance(links, Mapping):
            for req_id in ids:
                span_context = links.get(req_id)
                if span_context is not None:
                    self.span.add_link(span_context, {n.REQUEST_ID: req_id})
        else:
            for link in links:
                if isinstance(link, Link):
                    self.span.add_link(link.context, link.attributes)
                elif link is not None:
                    self.span.add_link(link)


class RequestSpan(_Scope):
    """`stepscope.request`: one request in the API process, from arrival to its last byte."""

    __slots__ = ("_ended", "_input_tokens", "_output_tokens", "_usage_set")

    def __init__(self, span: Span, input_tokens: int | None = None) -> None:
        super().__init__(span)
        self._input_tokens = input_tokens
        self._output_tokens = 0
        self._usage_set = False
        self._ended = False

    def current(self) -> AbstractContextManager[Span]:
        """Make this span current for a while without ending it (e.g. around one send)."""
        return trace.use_span(self.span, end_on_exit=False)

    @property
    def carrier(self) -> dict[str, str]:
        """This request span's context, for a message sent outside a `send_span`."""
        return inject_context(trace.set_span_in_context(self.span))

    def event(
        self, name: str, time_s: float | None = None, attributes: Mapping[str, Any] | None = None
    ) -> None:
        """A timeline event; `time_s` is a `time.time()` value (default: now)."""
        timestamp = None if time_s is None else int(time_s * 1e9)
        # str(): a `RequestEvent` from an in-process engine core goes out as its plain value.
        self.span.add_event(str(name), attributes, timestamp=timestamp)

    def add_events(self, events: Mapping[str, float | Sequence[float]]) -> None:
        """Events by name, as the engine core reports them (`EngineCoreOutput.events`)."""
        for name, times in events.items():
            if isinstance(times, int | float):
                self.event(name, times)
            else:
                for time_s in times:
                    self.event(name, time_s)

    def observe(self, output: Any) -> None:
        """Take in one `EngineCoreOutput`: its events, new tokens, cache hits and finish."""
        events = getattr(output, "events", None)
        if events:
            self.add_events(events)
        self._output_tokens += len(getattr(output, "new_token_ids", ()) or ())
        num_cached = getattr(output, "num_cached_tokens", None)
        if num_cached is not None:
            self.span.set_attribute(n.NUM_CACHED_TOKENS, num_cached)
        num_preemptions = getattr(output, "num_preemptions", None)
        if num_preemptions is not None:
            self.span.set_attribute(n.NUM_PREEMPTIONS, num_preemptions)
        finish_reason = getattr(output, "finish_reason", None)
        if finish_reason is not None:
            self.span.set_attribute(n.GEN_AI_RESPONSE_FINISH_REASONS, [finish_reason])

    def record_prompt(
        self,
        token_ids: Sequence[int],
        block_size: int,
        sampling_params: str,
        *,
        content: bool = False,
    ) -> None:
        """What a replay needs to send this request again: the prompt's chained block hashes
        at the engine's `block_size`, the SamplingParams (JSON text) and, with `content`
        (`--trace-content`), the prompt's token ids."""
        attributes: dict[str, Any] = {
            n.PROMPT_BLOCK_HASHES: prompt_block_hashes(token_ids, block_size),
            n.SAMPLING_PARAMS: sampling_params,
        }
        if content:
            attributes[n.PROMPT_TOKEN_IDS] = list(token_ids)
        self.span.set_attributes(attributes)

    def finish(
        self,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        finish_reasons: Sequence[str] | None = None,
        num_cached_tokens: int | None = None,
        num_preemptions: int | None = None,
        output_value: str | None = None,
    ) -> None:
        """Usage and outcome, when known better than `observe` counted them. `output_value`
        (the generated text) only when the user asked for content (`--trace-content`)."""
        attributes: dict[str, Any] = {}
        if input_tokens is not None:
            self._input_tokens = input_tokens
            attributes[n.GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
            attributes[n.LLM_TOKEN_COUNT_PROMPT] = input_tokens
        if output_tokens is not None:
            attributes.update(self._output_usage(output_tokens))
            self._usage_set = True
        if output_value is not None:
            attributes[n.OUTPUT_VALUE] = output_value
            attributes[n.OUTPUT_MIME_TYPE] = n.MIME_TYPE_TEXT
        if finish_reasons is not None:
            attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] = list(finish_reasons)
        if num_cached_tokens is not None:
            attributes[n.NUM_CACHED_TOKENS] = num_cached_tokens
        if num_preemptions is not None:
            attributes[n.NUM_PREEMPTIONS] = num_preemptions
        self.span.set_attributes(attributes)

    def _output_usage(self, output_tokens: int) -> dict[str, int]:
        """The output count under both conventions, and the total where the input is known."""
        usage = {
            n.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            n.LLM_TOKEN_COUNT_COMPLETION: output_tokens,
        }
        if self._input_tokens is not None:
            usage[n.LLM_TOKEN_COUNT_TOTAL] = self._input_tokens + output_tokens
        return usage

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if not self._usage_set:
            self.span.set_attributes(self._output_usage(self._output_tokens))
        self.span.end()


# ---- the helpers ---------------------------------------------------------------------------------
def request_span(
    request_id: str,
    *,
    model: str,
    operation: str = n.OPERATION_CHAT,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    input_tokens: int | None = None,
    headers: Mapping[str, str] | None = None,
    server: bool = True,
    start_ns: int | None = None,
    input_value: str | None = None,
) -> RequestSpan | _Noop:
    """`stepscope.request`, the root of one request (parented on an incoming `traceparent`).

    Recorded whatever `--trace-steps` says. `server=False` for offline use (kind INTERNAL). Use
    it as a context manager, or call `.end()` when the last byte is out. `input_value` (the
    prompt text) only when the user asked for content (`--trace-content`).
    """
    state = _setup.state
    if state is None:
        return NOOP
    attributes: dict[str, Any] = {
        **_LLM,
        n.REQUEST_ID: request_id,
        n.GEN_AI_OPERATION_NAME: operation,
        n.GEN_AI_REQUEST_MODEL: model,
        n.LLM_MODEL_NAME: model,
    }
    for key, value in (
        (n.GEN_AI_REQUEST_MAX_TOKENS, max_tokens),
        (n.GEN_AI_REQUEST_TEMPERATURE, temperature),
        (n.GEN_AI_REQUEST_TOP_P, top_p),
        (n.GEN_AI_USAGE_INPUT_TOKENS, input_tokens),
        (n.LLM_TOKEN_COUNT_PROMPT, input_tokens),
    ):
        if value is not None:
            attributes[key] = value
    if input_value is not None:
        attributes[n.INPUT_VALUE] = input_value
        attributes[n.INPUT_MIME_TYPE] = n.MIME_TYPE_TEXT
    span = state.tracer.start_span(
        n.REQUEST,
        context=extract_context(headers),
        kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
        attributes=attributes,
        start_time=start_ns,
    )
    return RequestSpan(span, input_tokens)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """One hash per full block of the prompt, each over its block's token ids and the hash
    before it (as the prefix cache chains its own): two prompts share their first k blocks
    exactly when their first k hashes are equal. 8 bytes of BLAKE2b, as hex."""
    out: list[str] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        out.append(parent.hex())
    return out


def step_span(
    stats: Any = None,
    request_ids: Sequence[str] | Mapping[str, int] = (),
    request_num_tokens: Sequence[int] | None = None,
    links: Mapping[str, SpanContext | None] | Iterable[SpanContext | Link | None] = (),
    *,
    step: int | None = None,
    kv_total_blocks: int | None = None,
    start_ns: int | None = None,
) -> StepSpan | _Noop:
    """`stepscope.engine_step`, the root of one step's trace, linked to the requests it served.

    Pass the `StepStats` now, or start it with `step=` before `schedule()` and call
    `.record(stats, ...)` once the scheduler has decided.
    """
    state = _setup.state
    if state is None:
        return NOOP
    if step is None and stats is not None:
        step = stats.step
    if not state.sampling.records(step):
        return NOOP
    span = state.tracer.start_span(
        n.ENGINE_STEP,
        context=Context(),
        kind=SpanKind.INTERNAL,
        attributes=_CHAIN if step is None else {**_CHAIN, n.STEP: step},
        start_time=start_ns,
    )
    scope = StepSpan(span)
    if stats is not None:
        scope.record(stats, request_ids, request_num_tokens, links, kv_total_blocks=kv_total_blocks)
    return scope


def child_span(name: str, attributes: Mapping[str, Any] | None = None) -> _Scope | _Noop:
    """A phase inside the current step or worker step (schedule, execute, forward, ...).

    Recorded only under a recording parent, so it follows the step's sampling.
    """
    state = _setup.state
    if state is None or not trace.get_current_span().is_recording():
        return NOOP
    return _Scope(
        state.tracer.start_span(
            name, attributes=_CHAIN if not attributes else {**_CHAIN, **attributes}
        )
    )


def ended_child_span(name: str, start_ns: int, end_ns: int) -> None:
    """A phase inside the current step that has already happened, timed by the caller (the
    engine core schedules before it knows whether the step runs and so deserves a span)."""
    state = _setup.state
    if state is None or not trace.get_current_span().is_recording():
        return
    state.tracer.start_span(name, attributes=_CHAIN, start_time=start_ns).end(end_time=end_ns)


def dp_publish_span(
    loads: Sequence[Sequence[int]], report_age_ms: Sequence[int], start_ns: int, end_ns: int
) -> None:
    """`stepscope.dp_publish`: the DP coordinator sent every rank's `[waiting, running, lost]`
    (with how old each rank's last report was) to the API servers, between these two times."""
    state = _setup.state
    if state is None:
        return
    span = state.tracer.start_span(
        n.DP_PUBLISH,
        start_time=start_ns,
        attributes={
            **_CHAIN,
            n.DP_NUM_WAITING: [load[0] for load in loads],
            n.DP_NUM_RUNNING: [load[1] for load in loads],
            n.DP_LOST: [load[2] for load in loads],
            n.DP_REPORT_AGE_MS: list(report_age_ms),
        },
    )
    span.end(end_time=end_ns)


class WorkerStepSpan(_Scope):
    """`stepscope.worker_step`: ends with the process's CPU time since it started (every thread's,
    as the forward's OpenMP threads work for the step too; in an offline run, where every role
    shares the process, the engine core's and API side's share of those moments as well)."""

    __slots__ = ("_cpu_start_ns",)

    def __init__(self, span: Span) -> None:
        super().__init__(span)
        self._cpu_start_ns = process_time_ns()

    def end(self) -> None:
        self.span.set_attribute(n.CPU_TIME_NS, process_time_ns() - self._cpu_start_ns)
        self.span.end()


def worker_step_span(
    step: int, rank: int, carrier: Mapping[str, str] | None = None, num_threads: int | None = None
) -> WorkerStepSpan | _Noop:
    """`stepscope.worker_step` on one worker: under the SchedulerOutput's context when it came
    over a boundary (`carrier`), else under the current span (in-process executor). It records
    the process's CPU time over the step and, when given, the threads the forward could use."""
    state = _setup.state
    if state is None or state.sampling.off:
        return NOOP
    parent: Context | None = extract_context(carrier)
    remote = trace.get_current_span(parent).get_span_context()
    if remote.is_valid:
        if not remote.trace_flags.sampled:
            return NOOP
    else:
        parent = None  # the current context
        current = trace.get_current_span()
        if current.get_span_context().is_valid:
            if not current.is_recording():
                return NOOP
        elif state.sampling.records(step):
            parent = Context()
        else:
            return NOOP
    span = state.tracer.start_span(
        n.WORKER_STEP,
        context=parent,
        kind=SpanKind.INTERNAL,
        attributes={**_CHAIN, n.STEP: step, n.RANK: rank},
    )
    if num_threads is not None:
        span.set_attribute(n.NUM_THREADS, num_threads)
    return WorkerStepSpan(span)
