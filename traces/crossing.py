"""One message over one process boundary, traced: one call at each end of each boundary.

    data = traced_send(crossing.ENGINE_CORE_TO_WORKER, encoder.encode, scheduler_output,
                       step=scheduler_output.step, send=broadcast)      # sender
    out = traced_receive(crossing.ENGINE_CORE_TO_WORKER, decoder.decode, data)  # receiver

`traced_send` starts the `stepscope.send` span (PRODUCER), puts its context in the message's
`trace_context`, encodes the message, records the byte count and, given `send`, hands the bytes
on inside the span. `traced_receive` decodes and records the `stepscope.receive` span (CONSUMER)
as a child of that send, covering the decode. Span names and attributes are those of `send_span`
and `receive_span` (docs/tracing.md).

The four boundaries of the request path are declared here once, with how each message says how
many requests it serves (and which, or which step, where the span names them). Messages are
duck-typed: any struct with a `trace_context` dict crosses; `traces/` imports nothing of the
engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from stepscope.traces import names as n
from stepscope.traces import setup as _setup
from stepscope.traces.crossing_spans import receive_span, send_span

__all__ = [
    "API_TO_ENGINE_CORE",
    "ENGINE_CORE_TO_API",
    "ENGINE_CORE_TO_WORKER",
    "WORKER_TO_ENGINE_CORE",
    "Boundary",
    "CarriesContext",
    "traced_receive",
    "traced_send",
]


class CarriesContext(Protocol):
    """A message that carries its sender's trace context (a W3C carrier dict)."""

    trace_context: dict[str, str]


M = TypeVar("M", bound=CarriesContext)


@dataclass(frozen=True, slots=True)
class Boundary:
    """One boundary and the message that crosses it, as its crossing spans describe it."""

    label: str  # `stepscope.boundary`
    message_type: str  # `stepscope.message_type`
    num_requests: Callable[[Any], int]
    # The requests to name in the span (`stepscope.request_ids`), for messages sent outside a step.
    request_ids: Callable[[Any], Sequence[str]] | None = None
    # The step a message belongs to, when it says (decides sampling where no context came along).
    step: Callable[[Any], int] | None = None

    def describe(self, message: Any) -> tuple[int, Sequence[str] | None]:
        """`(num_requests, request_ids)` of one message."""
        if self.request_ids is None:
            return self.num_requests(message), None
        ids = self.request_ids(message)
        return len(ids), ids


API_TO_ENGINE_CORE = Boundary(n.API_TO_ENGINE_CORE, "EngineCoreRequest", lambda m: 1)
ENGINE_CORE_TO_WORKER = Boundary(
    n.ENGINE_CORE_TO_WORKER,
    "SchedulerOutput",
    lambda m: len(m.num_scheduled_tokens),
    step=lambda m: m.step,
)
WORKER_TO_ENGINE_CORE = Boundary(
    n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", lambda m: len(m.req_ids)
)
ENGINE_CORE_TO_API = Boundary(
    n.ENGINE_CORE_TO_API,
    "EngineCoreOutputs",
    lambda m: len(m.outputs),
    request_ids=lambda m: [o.request_id for o in m.outputs],
)


def traced_send(
    boundary: Boundary,
    encode: Callable[[M], bytes],
    message: M,
    *,
    step: int | None = None,
    send: Callable[[bytes], object] | None = None,
    dp_rank: int | None = None,
) -> bytes:
    """Encode `message` inside its `stepscope.send` span, carrying the span's context in it.

    `send` (optional) hands the bytes on inside the span; the bytes are returned either way.
    `step` defaults to the message's own (`Boundary.step`); `dp_rank` is the engine core's
    data-parallel rank when the API process sends to one of several.
    """
    if _setup.state is None:  # tracing off: the message alone
        data = encode(message)
        if send is not None:
            send(data)
        return data
    if step is None and boundary.step is not None:
        step = boundary.step(message)
    num_requests, request_ids = boundary.describe(message)
    crossing, carrier = send_span(
        boundary.label,
        boundary.message_type,
        num_requests=num_requests,
        step=step,
        request_ids=request_ids,
        dp_rank=dp_rank,
    )
    with crossing:
        message.trace_context = carrier
        data = encode(message)
        crossing.set_nbytes(len(data))
        if send is not None:
            send(data)
    return data


def traced_receive(
    boundary: Boundary,
    decode: Callable[[Any], M],
    data: bytes | memoryview,
    *,
    step: int | None = None,
    dp_rank: int | None = None,
) -> M:
    """Decode a message inside its `stepscope.receive` span, a child of the sender's send span.

    `step` defaults to the message's own (`Boundary.step`); `dp_rank` as for `traced_send`.
    """
    if _setup.state is None:
        return decode(data)
    start_ns = time.time_ns()
    message = decode(data)
    if step is None and boundary.step is not None:
        step = boundary.step(message)
    num_requests, request_ids = boundary.describe(message)
    receive_span(
        boundary.label,
        boundary.message_type,
        len(data),
        num_requests,
        message.trace_context,
        step=step,
        request_ids=request_ids,
        start_ns=start_ns,
        dp_rank=dp_rank,
    ).end()
    return message
