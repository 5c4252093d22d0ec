"""`stepscope trace export`: a trace as Chrome trace-event JSON, for Perfetto UI and chrome://tracing.

One process of the timeline per stepscope process (API server, DP coordinator, engine core per DP
rank, worker per TP and DP rank, or the one offline process), told apart by the resource of its
spans: `service.name`, `stepscope.rank`, `stepscope.dp_rank` and `process.pid` when recorded.
Every span but the request spans becomes a complete (`X`) slice on a thread of its process; each
request becomes an async slice (`b`/`e`) with its queue, prefill and decode phases, plus a short
`X` marker where it was handed to the engine core, since flow arrows start only from thread
slices. Arrows (`s`/`f`) run from each request's marker to every step that served it and along
every parent link that crosses processes; counters (`C`) carry each engine core's load per step.

Times are microseconds from the trace's first span.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from stepscope.traces import names as n
from stepscope.traces.backend import queries
from stepscope.traces.backend.source import Queryable, open_trace

# Threads of a process, in the order the timeline shows them: group -> (thread name, may nest).
# Requests never nest: one request's marker inside another's would read as a parent.
_GROUPS = {
    "steps": ("steps", True),
    "requests": ("requests", False),
    "messages": ("messages", True),
    "publications": ("load publications", True),
    "other": ("other spans", True),
}
_ROOT_GROUPS = {
    n.ENGINE_STEP: "steps",
    n.WORKER_STEP: "steps",
    n.SEND: "messages",
    n.RECEIVE: "messages",
    n.DP_PUBLISH: "publications",
}
# API servers first, then the DP coordinator, engine cores, workers.
_SERVICE_ORDER = {
    n.SERVICE_API: 0,
    n.SERVICE_OFFLINE: 0,
    n.SERVICE_DP_COORDINATOR: 1,
    n.SERVICE_ENGINE_CORE: 2,
    n.SERVICE_WORKER: 3,
}
REQUEST_CATEGORY = "request"  # async slices: a request and its phases
STEP_FLOW = "request->step"  # flow category and name: a request to a step that served it
CROSSING_FLOW = "crossing"  # flow category: a parent span to its child in another process
MARKER_NS = 1000  # a request marker without a send span to copy lasts 1 us


def _us(ns: float) -> float:
    """ns -> us. A quarter ns more, so that a reader that multiplies by 1000 and truncates
    (Perfetto does) gets the exact ns back, and a child never ends past its parent."""
    return (ns + 0.25) / 1000


@dataclass(slots=True, eq=False)
class _Process:
    service: str
    rank: int | None
    dp_rank: int | None
    os_pid: int | None
    pid: int = 0
    # group -> its threads, each a stack of the slices open on it while packing
    lanes: dict[str, list[list[_Slice]]] = field(default_factory=dict)
    tids: dict[tuple[str, int], int] = field(default_factory=dict)

    def sort_key(self) -> tuple[int, int, int, int, str]:
        order = _SERVICE_ORDER.get(self.service, 4)
        return (order, _or(self.dp_rank, -1), _or(self.rank, -1), _or(self.os_pid, 0), self.service)

    def label(self) -> str:
        dp = "" if self.dp_rank is None else f" DP {self.dp_rank}"
        rank = "" if self.rank is None else f" {self.rank}"
        name = {
            n.SERVICE_API: f"API server{rank}",
            n.SERVICE_DP_COORDINATOR: "DP coordinator",
            n.SERVICE_ENGINE_CORE: f"engine core{dp}",
            n.SERVICE_WORKER: f"worker{'' if self.rank is None else ' TP'}{rank}{dp}",
            n.SERVICE_OFFLINE: "offline LLM (API, engine core and worker)",
        }.get(self.service, self.service)
        return name if self.os_pid is None else f"{name} (pid {self.os_pid})"


@dataclass(slots=True, eq=False)
class _Slice:
    """One `X` event: a span, or a request's marker, on a thread of its process."""

    span_id: str
    parent_id: str | None
    name: str  # the span name: the event's category
    label: str  # what the timeline shows on the slice
    start: int  # ns from the trace's first span
    end: int
    args: dict[str, Any]
    process: _Process
    group: str = "other"
    depth: int = 0
    lane: int = 0  # its thread among its group's threads
    tid: int = 0
    first_child: int | None = None  # start of its first child on its thread
    flows: list[dict[str, Any]] = field(default_factory=list)  # flow ends bound to it

    def bind_ns(self) -> float:
        """A time inside the slice before any child opens: a flow end there binds to it."""
        return (self.start + (self.end if self.first_child is None else self.first_child)) / 2

    def events(self) -> list[dict[str, Any]]:
        """Its `X` event, then the flow ends bound to it: a reader that keeps the file's order
        among events of one time binds an end at its start to it, not to a child starting then."""
        where = {"pid": self.process.pid, "tid": self.tid}
        x = {"ph": "X", "name": self.label, "cat": self.name, "ts": _us(self.start)}
        x |= {"dur": _us(self.end - self.start), "args": self.args}
        return [where | x, *(where | flow for flow in self.flows)]


@dataclass(slots=True)
class _Request:
    request_id: str
    start: int
    end: int
    times: dict[str, int | None]  # queued, scheduled, first_token, finished
    preempted: list[int]
    dp_rank: int
    args: dict[str, Any]
    marker: _Slice


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA


def _py(value: Any) -> Any:
    """A column value as plain Python (numpy scalars are not JSON), None for SQL NULL."""
    if _missing(value):
        return None
    return value.item() if hasattr(value, "item") else value


def _int(value: Any) -> int | None:
    """An integer column value, None for SQL NULL (pandas NaN / NA)."""
    return None if _missing(value) else int(value)


def _json(value: Any) -> Any:
    if isinstance(value, str):
        return json.loads(value)
    return {} if _missing(value) else value


class _Processes:
    """The processes of the trace, by their spans' resource."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[Any, ...], _Process] = {}
        self.by_resource: dict[str, _Process] = {}

    def of(self, resource: Any, service: Any) -> _Process:
        text = resource if isinstance(resource, str) else json.dumps(resource, sort_keys=True)
        process = self.by_resource.get(text)
        if process is None:
            attrs = _json(resource) or {}
            service = attrs.get(n.SERVICE_NAME) or (service if isinstance(service, str) else None)
            key = (service or "unknown", attrs.get(n.RANK), attrs.get(n.DP_RANK))
            key += (attrs.get(n.PROCESS_PID),)
            process = self.by_key.get(key)
            if process is None:
                process = self.by_key[key] = _Process(*key)
            self.by_resource[text] = process
        return process

    def ordered(self) -> list[_Process]:
        processes = sorted(self.by_key.values(), key=_Process.sort_key)
        for index, process in enumerate(processes):
            process.pid = index + 1
        return processes


# ---- reading the trace ---------------------------------------------------------------------------
_SPANS = f"""
SELECT trace_id, span_id, parent_span_id, name, service_name, start_ns - $1 AS t_start,
       end_ns - $1 AS t_end, attributes, resource
FROM spans WHERE name <> '{n.REQUEST}' ORDER BY start_ns
"""

_REQUESTS = """
SELECT r.request_id, r.start_ns - $1 AS t_start, r.end_ns - $1 AS t_end,
       r.queued_ns - $1 AS queued, r.scheduled_ns - $1 AS scheduled,
       r.first_token_ns - $1 AS first_token, r.finished_ns - $1 AS finished,
       r.input_tokens, r.output_tokens, r.cached_tokens, r.num_preemptions, r.finish_reason,
       r.queue_time_s, r.ttft_s, r.e2e_s, r.dp_rank, r.trace_id, r.span_id,
       s.service_name, s.resource, s.events
FROM requests r JOIN spans s ON s.trace_id = r.trace_id AND s.span_id = r.span_id
ORDER BY r.start_ns
"""

_STEP_REQUESTS = f"""
SELECT sr.request_id, sr.num_tokens, s.span_id, s.dp_rank
FROM step_requests sr JOIN steps s ON {queries.STEP_JOIN}
ORDER BY sr.start_ns
"""


def _label(name: str, attrs: dict[str, Any]) -> str:
    if name == n.ENGINE_STEP:
        return f"step {attrs.get(n.STEP)}"
    if name == n.WORKER_STEP:
        return f"worker step {attrs.get(n.STEP)}"
    if name in (n.SEND, n.RECEIVE):
        return f"{'send' if name == n.SEND else 'receive'} {attrs.get(n.MESSAGE_TYPE, '')}".strip()
    if name == n.DP_PUBLISH:
        return "publish loads"
    return name.removeprefix("stepscope.")


def _args(attrs: dict[str, Any], trace_id: str, span_id: str) -> dict[str, Any]:
    args = {key.removeprefix("stepscope."): value for key, value in attrs.items()}
    budget = attrs.get(n.TOKEN_BUDGET)
    if budget:
        tokens = attrs.get(n.NUM_DECODE_TOKENS, 0) + attrs.get(n.NUM_PREFILL_TOKENS, 0)
        args["budget_used"] = round(tokens / budget, 4)
    return args | {"trace_id": trace_id, "span_id": span_id}


def _spans(source: Queryable, t0: int, processes: _Processes) -> dict[str, _Slice]:
    """Every span but the request spans, by span id, with its thread group and depth."""
    slices: dict[str, _Slice] = {}
    for row in queries.df(source, _SPANS, [t0]).itertuples(index=False):
        attrs = _json(row.attributes)
        parent = row.parent_span_id if isinstance(row.parent_span_id, str) else None
        slices[row.span_id] = _Slice(
            span_id=row.span_id,
            parent_id=parent,
            name=row.name,
            label=_label(row.name, attrs),
            start=int(row.t_start),
            end=max(int(row.t_end), int(row.t_start)),
            args=_args(attrs, row.trace_id, row.span_id),
            process=processes.of(row.resource, row.service_name),
        )
    for slice_ in slices.values():
        # Its root in its own process decides its thread: a step's messages stay on its steps.
        root, depth = slice_, 0
        while (parent := slices.get(root.parent_id or "")) and parent.process is slice_.process:
            root, depth = parent, depth + 1
        slice_.group, slice_.depth = _ROOT_GROUPS.get(root.name, "other"), depth
    return slices


def _requests(
    source: Queryable, t0: int, processes: _Processes, slices: dict[str, _Slice]
) -> list[_Request]:
    # Where each request left the API process: its api->engine_core send, when recorded.
    sends = {
        s.parent_id: s
        for s in slices.values()
        if s.name == n.SEND and s.args.get("boundary") == n.API_TO_ENGINE_CORE
    }
    out = []
    for row in queries.df(source, _REQUESTS, [t0]).to_dict(orient="records"):
        start = int(row["t_start"])
        end = max(int(row["t_end"]), start)
        times = {k: _int(row[k]) for k in ("queued", "scheduled", "first_token", "finished")}
        events = _json(row["events"]) or []
        preempted = [
            int(e["time_ns"]) - t0 for e in events if e.get("name") == n.RequestEvent.PREEMPTED
        ]
        args = {
            k: _py(row[k])
            for k in ("request_id", "input_tokens", "output_tokens", "cached_tokens",
                      "num_preemptions", "finish_reason", "dp_rank", "trace_id", "span_id")
        }  # fmt: skip
        for key in ("queue_time_s", "ttft_s", "e2e_s"):
            if not _missing(row[key]):
                args[key.removesuffix("_s") + "_ms"] = round(row[key] * 1e3, 3)
        process = processes.of(row["resource"], row["service_name"])
        send = sends.get(row["span_id"])
        at = _or(times["queued"], start)
        first, last = (send.start, send.end) if send else (at, at + MARKER_NS)
        marker = _Slice(
            span_id=row["span_id"],
            parent_id=None,
            name=n.REQUEST,
            label=f"request {row['request_id']}",
            start=first,
            end=max(last, first + 1),
            args=args,
            process=process,
            group="requests",
        )
        dp_rank = _or(_int(row["dp_rank"]), 0)
        out.append(
            _Request(str(row["request_id"]), start, end, times, preempted, dp_rank, args, marker)
        )
    return out


# ---- threads -------------------------------------------------------------------------------------
def _pack(slices: list[_Slice]) -> None:
    """Put each slice on a thread of its process where it nests properly (Chrome's rule for
    slices on one thread): the first thread of its group whose open slices it fits inside, or a
    new one. Parents come before their children, so a step's children land on its thread."""
    for s in sorted(slices, key=lambda s: (s.start, -s.end, s.depth)):
        lanes = s.process.lanes.setdefault(s.group, [])
        nest = _GROUPS[s.group][1]
        s.lane = len(lanes)
        for lane, open_slices in enumerate(lanes):
            while open_slices and open_slices[-1].end <= s.start:
                open_slices.pop()  # ended before s starts (slices come in start order)
            if not open_slices or (nest and s.end <= open_slices[-1].end):
                s.lane = lane
                break
        else:
            lanes.append([])
        stack = lanes[s.lane]
        if stack and stack[-1].first_child is None:
            stack[-1].first_child = s.start
        stack.append(s)


def _threads(processes: list[_Process], tids: Iterator[int]) -> list[dict[str, Any]]:
    """Give each thread a trace-wide tid; return the metadata events naming processes and
    threads."""
    events: list[dict[str, Any]] = []
    for process in processes:
        threads = [
            (group, lane) for group in _GROUPS for lane in range(len(process.lanes.get(group, [])))
        ]
        for sort_index, (group, lane) in enumerate(threads):
            tid = process.tids[group, lane] = next(tids)
            name = _GROUPS[group][0] + ("" if lane == 0 else f" {lane + 1}")
            meta = {"ph": "M", "pid": process.pid, "tid": tid}
            events.append(meta | {"name": "thread_name", "args": {"name": name}})
            events.append(meta | {"name": "thread_sort_index", "args": {"sort_index": sort_index}})
        # A process's own metadata names one of its threads: Perfetto would otherwise make a
        # thread with tid = pid, which may be another process's thread.
        meta = {"ph": "M", "pid": process.pid, "tid": process.tids[threads[0]]}
        events.append(meta | {"name": "process_name", "args": {"name": process.label()}})
        events.append(meta | {"name": "process_sort_index", "args": {"sort_index": process.pid}})
    return events


# ---- events --------------------------------------------------------------------------------------
def _async(request: _Request, ids: Iterator[int]) -> list[dict[str, Any]]:
    """A request's async slice, with its phases nested in order and its preemptions."""
    base = {
        "cat": REQUEST_CATEGORY,
        "id": next(ids),
        "pid": request.marker.process.pid,
        "tid": request.marker.tid,
    }

    def clamp(ns: int) -> int:
        return min(max(ns, request.start), request.end)

    label = f"request {request.request_id}"
    events = [base | {"ph": "b", "name": label, "ts": _us(request.start), "args": request.args}]
    # Each phase runs to the next known event; a request aborted early lacks the later ones.
    t = request.times
    bounds = [
        ("queue", t["queued"]),
        ("prefill", t["scheduled"]),
        ("decode", t["first_token"]),
        (None, _or(t["finished"], request.end)),
    ]
    known = [(phase, clamp(ns)) for phase, ns in bounds if ns is not None]
    for (phase, begin), (_, end) in itertools.pairwise(known):
        if phase is not None and end > begin:
            events.append(base | {"ph": "b", "name": phase, "ts": _us(begin)})
            events.append(base | {"ph": "e", "name": phase, "ts": _us(end)})
    for ns in request.preempted:
        events.append(base | {"ph": "n", "name": "preempted", "ts": _us(clamp(ns))})
    events.append(base | {"ph": "e", "name": label, "ts": _us(request.end)})
    return events


def _flow(flow_id: int, cat: str, name: str, src: _Slice, dst: _Slice, args: dict) -> None:
    """An arrow from `src` to `dst`: its two ends, each kept with the slice it binds to."""
    common = {"id": flow_id, "cat": cat, "name": name}
    src.flows.append(common | {"ph": "s", "ts": _us(src.bind_ns()), "args": args})
    dst.flows.append(common | {"ph": "f", "bp": "e", "ts": _us(dst.bind_ns())})


def _step_counters(step: _Slice) -> list[dict[str, Any]]:
    """The engine core's load at a step: requests, free KV blocks (before and after), budget."""
    a = step.args
    base = {"ph": "C", "pid": step.process.pid, "tid": step.tid}
    events = [
        base | {"name": "requests", "ts": _us(step.start),
                "args": {"running": a.get("num_running", 0), "waiting": a.get("num_waiting", 0)}},
    ]  # fmt: skip
    if "kv_free_before" in a:
        free = {"name": "KV blocks", "ts": _us(step.start), "args": {"free": a["kv_free_before"]}}
        events.append(base | free)
    if "kv_free_after" in a:
        free = {"name": "KV blocks", "ts": _us(step.end), "args": {"free": a["kv_free_after"]}}
        events.append(base | free)
    if "budget_used" in a:
        used = {"name": "token budget", "ts": _us(step.start), "args": {"used": a["budget_used"]}}
        events.append(base | used)
    return events


def _step_flows(
    source: Queryable,
    slices: dict[str, _Slice],
    requests: list[_Request],
    flow_ids: Iterator[int],
) -> None:
    """An arrow from each request's marker to every step that scheduled tokens for it."""
    by_id: dict[str, list[_Request]] = defaultdict(list)
    for request in requests:
        by_id[request.request_id].append(request)
    for row in queries.df(source, _STEP_REQUESTS).itertuples(index=False):
        step = slices.get(row.span_id)
        candidates = by_id.get(str(row.request_id))
        if step is None or not candidates:
            continue  # a request whose span is not in the trace (still running, or not sampled)
        # Request ids repeat across runs in one file: the one on this rank, running then.
        request = min(
            candidates,
            key=lambda r: (r.dp_rank != row.dp_rank, not r.start <= step.start <= r.end),
        )
        args = {"request_id": request.request_id, "num_tokens": _int(row.num_tokens)}
        _flow(next(flow_ids), STEP_FLOW, STEP_FLOW, request.marker, step, args)


def _crossing_flows(slices: dict[str, _Slice], flow_ids: Iterator[int]) -> None:
    """An arrow along every parent link between two processes: a send to its receive, a
    SchedulerOutput's send to the worker step it started."""
    for child in slices.values():
        parent = slices.get(child.parent_id or "")
        if parent is not None and parent.process is not child.process:
            name = parent.args.get("boundary") or child.args.get("boundary") or "context"
            args = {"from": parent.label, "to": child.label}
            _flow(next(flow_ids), CROSSING_FLOW, name, parent, child, args)


def _dp_load_counters(source: Queryable, slices: dict[str, _Slice]) -> list[dict[str, Any]]:
    """The load of each DP rank as the coordinator published it (what API servers routed by)."""
    events = []
    loads = queries.df(source, "SELECT * FROM dp_loads ORDER BY time_ns, dp_rank")
    for row in loads.itertuples(index=False):
        publish = slices.get(row.span_id)
        if publish is not None:
            events.append({
                "ph": "C", "name": f"published load DP {row.dp_rank}",
                "pid": publish.process.pid, "tid": publish.tid, "ts": _us(publish.start),
                "args": {"running": int(row.num_running), "waiting": int(row.num_waiting)},
            })  # fmt: skip
    return events


# ---- the export ----------------------------------------------------------------------------------
def export_chrome(source: Queryable) -> dict[str, Any]:
    """The trace as Chrome trace-event JSON (the JSON Object Format): `traceEvents`, with
    `otherData` saying how many processes, requests and steps it holds."""
    t0 = _int(queries.df(source, "SELECT min(start_ns) AS t0 FROM spans")["t0"].iloc[0])
    if t0 is None:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": _counts(0, 0, 0)}
    processes = _Processes()
    slices = _spans(source, t0, processes)
    requests = _requests(source, t0, processes, slices)
    ordered = processes.ordered()
    every = [*slices.values(), *(r.marker for r in requests)]
    _pack(every)
    events = _threads(ordered, itertools.count(1))
    for slice_ in every:
        slice_.tid = slice_.process.tids[slice_.group, slice_.lane]
    flow_ids = itertools.count(1)
    _step_flows(source, slices, requests, flow_ids)
    _crossing_flows(slices, flow_ids)

    for slice_ in sorted(every, key=lambda s: (s.start, s.depth)):
        events += slice_.events()
    async_ids = itertools.count(1)
    for request in requests:
        events += _async(request, async_ids)
    steps = [s for s in slices.values() if s.name == n.ENGINE_STEP]
    for step in steps:
        events += _step_counters(step)
    events += _dp_load_counters(source, slices)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": _counts(len(ordered), len(requests), len(steps)),
    }


def _counts(processes: int, requests: int, steps: int) -> dict[str, Any]:
    return {"exporter": "stepscope", "processes": processes, "requests": requests, "steps": steps}


def write_chrome(path_or_url: str, out_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Export a trace file (or a running collector's URL) to `out_path`; returns the trace."""
    with open_trace(path_or_url) as source:
        trace = export_chrome(source)
    trace["otherData"]["trace"] = path_or_url
    text = json.dumps(trace, separators=(",", ":"))
    try:
        with open(out_path, "w") as f:
            f.write(text)
    except OSError as error:
        raise ValueError(f"cannot write {out_path}: {error.strerror or error}") from error
    return trace
