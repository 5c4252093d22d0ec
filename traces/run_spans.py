"""The spans of a run as a whole, once each, not per request or step: `stepscope.run` (the
configuration a front end runs, for `stepscope trace replay`), and the engine's start:
`stepscope.engine_start` where the engine cores are started, with a `stepscope.process_start`
child per engine core and worker (Ray's placement and actor start where Ray placed it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from stepscope.traces import names as n
from stepscope.traces import setup as _setup
from stepscope.traces.spans import _CHAIN, extract_context


def run_span(engine_config: str, entry: str) -> None:
    """`stepscope.run`, once as a front end starts: the engine configuration it runs (JSON
    text) and how its requests come in (`offline` or `serve`), for `stepscope trace replay`."""
    state = _setup.state
    if state is None:
        return
    span = state.tracer.start_span(
        n.RUN,
        context=Context(),
        kind=SpanKind.INTERNAL,
        attributes={**_CHAIN, n.ENGINE_CONFIG: engine_config, n.ENTRY: entry},
    )
    span.end()


def start_span(
    name: str, parent: Mapping[str, str] | None = None, start_ns: int | None = None
) -> Span | None:
    """A span of the engine's start (`stepscope.engine_start`), under `parent` (a carrier),
    from `start_ns` (default: now); its context goes to the processes it starts
    (`inject_context`). None: not tracing."""
    state = _setup.state
    if state is None:
        return None
    return state.tracer.start_span(
        name, context=extract_context(parent), attributes=_CHAIN, start_time=start_ns
    )


def process_start_span(
    parent: Span | Mapping[str, str] | None,
    role: str,
    rank: int,
    start_ns: int,
    end_ns: int,
    pid: int | None,
    actor: Any = None,
    dp_rank: int | None = None,
) -> None:
    """`stepscope.process_start`: one engine core or worker from being asked for (`start_ns`) to
    ready, under `parent` (the engine start's span, or its carrier in another process). `actor`:
    the `ray_utils.ActorProcess` it runs in, whose placement and start times it records."""
    state = _setup.state
    if state is None or parent is None:
        return
    if isinstance(parent, Span):
        context = trace.set_span_in_context(parent)
    else:
        context = extract_context(parent)
    attributes: dict[str, Any] = {**_CHAIN, n.ROLE: role, n.RANK: rank,
                                  n.BACKEND: "process" if actor is None else "ray"}  # fmt: skip
    if dp_rank is not None:
        attributes[n.DP_RANK] = dp_rank
    if pid is not None:
        attributes[n.PROCESS_PID] = pid
    if actor is not None:
        attributes[n.RAY_PLACEMENT_S] = actor.placement_s
        attributes[n.RAY_ACTOR_START_S] = actor.actor_start_s
        attributes[n.RAY_NODE_ID] = actor.node_id
    state.tracer.start_span(
        n.PROCESS_START, context=context, attributes=attributes, start_time=start_ns
    ).end(end_time=end_ns)
