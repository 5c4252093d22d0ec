"""The spans of one message crossing one process boundary: `stepscope.send` (PRODUCER) where it
leaves, `stepscope.receive` (CONSUMER) where it arrives, linked by the trace context the message
carries. `crossing.traced_send` / `traced_receive` call these; the rest of the span helpers are
in spans.py, whose `NOOP`, scope and context helpers these share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from stepscope.traces import names as n
from stepscope.traces import setup as _setup
from stepscope.traces.spans import _CHAIN, _PROPAGATOR, NOOP, _Noop, _Scope, extract_context


class CrossingSpan(_Scope):
    """`stepscope.send` / `stepscope.receive`: one message over one boundary."""

    __slots__ = ()

    def set_nbytes(self, nbytes: int) -> None:
        """The payload size, once the message (which carries the context) is encoded."""
        self.span.set_attribute(n.MESSAGE_BODY_SIZE, nbytes)


def _crossing_attributes(
    boundary: str,
    message_type: str,
    nbytes: int | None,
    num_requests: int,
    request_ids: Sequence[str] | None,
    dp_rank: int | None = None,
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        **_CHAIN,
        n.BOUNDARY: boundary,
        n.MESSAGE_TYPE: message_type,
        n.NUM_REQUESTS: num_requests,
        n.MESSAGING_SYSTEM: n.MESSAGING_SYSTEM_ZMQ,
    }
    if nbytes is not None:
        attributes[n.MESSAGE_BODY_SIZE] = nbytes
    if request_ids is not None:
        attributes[n.REQUEST_IDS] = list(request_ids)
    if dp_rank is not None:
        attributes[n.DP_RANK] = dp_rank
    return attributes


def send_span(
    boundary: str,
    message_type: str,
    nbytes: int | None = None,
    num_requests: int = 0,
    *,
    step: int | None = None,
    request_ids: Sequence[str] | None = None,
    dp_rank: int | None = None,
) -> tuple[CrossingSpan | _Noop, dict[str, str]]:
    """`stepscope.send` (PRODUCER), started now, and the carrier to put inside the message.

    Recorded under a recording span (a step, a request), else when `step` is sampled. Set the
    size with `.set_nbytes()` once the message is encoded. `request_ids` names the requests
    a message serves when they are not one step's (e.g. EngineCoreOutputs). `dp_rank`: the
    data-parallel rank on the other side, where the sender is not a rank itself (the API).
    """
    state = _setup.state
    if state is None:
        return NOOP, {}
    current = trace.get_current_span()
    if state.sampling.off:
        record = False
    elif current.is_recording():
        record = True
    elif step is not None:
        record = state.sampling.records(step)
    else:
        record = state.sampling.all
    carrier: dict[str, str] = {}
    if not record:
        # Still carry the current context (a request span), so the engine core can link to it.
        _PROPAGATOR.inject(carrier)
        return NOOP, carrier
    span = state.tracer.start_span(
        n.SEND,
        kind=SpanKind.PRODUCER,
        attributes=_crossing_attributes(
            boundary, message_type, nbytes, num_requests, request_ids, dp_rank
        ),
    )
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    if getattr(current, "name", None) == n.REQUEST:
        parent = current.get_span_context()
        carrier[n.CARRIER_REQUEST] = f"{parent.trace_id:032x}-{parent.span_id:016x}"
    return CrossingSpan(span), carrier


def receive_span(
    boundary: str,
    message_type: str,
    nbytes: int | None,
    num_requests: int,
    carrier: Mapping[str, str] | None,
    *,
    step: int | None = None,
    request_ids: Sequence[str] | None = None,
    start_ns: int | None = None,
    dp_rank: int | None = None,
) -> CrossingSpan | _Noop:
    """`stepscope.receive` (CONSUMER), a child of the sender's `stepscope.send` via `carrier`.

    Follows the sender: recorded when the carrier holds a sampled context; without one, a new
    root when `step` is sampled (or, with no step, under `--trace-steps all`). `start_ns`
    (`time.time_ns()`) lets the span cover the decode that found the carrier.
    """
    state = _setup.state
    if state is None or state.sampling.off:
        return NOOP
    parent = extract_context(carrier)
    remote = trace.get_current_span(parent).get_span_context()
    if remote.is_valid:
        if not remote.trace_flags.sampled:
            return NOOP
    elif not (state.sampling.records(step) if step is not None else state.sampling.all):
        return NOOP
    span = state.tracer.start_span(
        n.RECEIVE,
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=_crossing_attributes(
            boundary, message_type, nbytes, num_requests, request_ids, dp_rank
        ),
        start_time=start_ns,
    )
    return CrossingSpan(span)
