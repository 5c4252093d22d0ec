"""The ten stages of one request's path (docs/request-path.md, section 2), measured from its spans.

`STAGES` is the one place in code that says, for each stage, which process runs it, what it does,
which object crosses a boundary there, and which spans measure it; the table in
docs/request-path.md lists the same stages (a test keeps the two in step). `stage_occurrences`
turns a request's spans into one row per occurrence of each stage: stages 4 to 8 once per step
that served the request (5 and 6 once per worker rank), stage 9 once per step that gave it tokens,
stage 3 again after each preemption.

HTTP parsing and tokenization are one stage: no span separates them, so stage 1 runs from the
request span's start (when the API process got the request, before tokenizing it) to the start of
its `EngineCoreRequest` send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pandas as pd

from stepscope.traces import names as n
from stepscope.traces.backend import queries


@dataclass(frozen=True, slots=True)
class Stage:
    number: int
    name: str
    process: str  # where it runs: "API server", "engine core", "worker", or a boundary "a -> b"
    action: str
    crosses: str  # the object that crosses a process boundary here ("" when none does)
    measured_by: str  # the spans (or span events) whose times make up the stage


STAGES: tuple[Stage, ...] = (
    Stage(1, "HTTP in + tokenize", "API server",
          "parse the HTTP request, apply the chat template, tokenize, validate",
          "", f"`{n.REQUEST}` start -> `EngineCoreRequest` send start"),
    Stage(2, "API -> engine core", "API server -> engine core",
          "send the request over ZMQ; the core's input thread decodes it",
          "EngineCoreRequest (ZMQ)", f"`{n.SEND}` + `{n.RECEIVE}` on `{n.API_TO_ENGINE_CORE}`"),
    Stage(3, "waiting queue", "engine core",
          "wait until the scheduler admits it (token budget, free KV blocks, max_num_seqs)",
          "", "request events `queued` -> `scheduled`"),
    Stage(4, "schedule", "engine core",
          "schedule(): running requests first, then waiting ones; allocate_slots",
          "", f"`{n.SCHEDULE}` of each step that served it"),
    Stage(5, "engine core -> worker", "engine core -> worker",
          "broadcast the step's diff to every worker",
          "SchedulerOutput (new requests, new block ids, token counts)",
          f"`{n.SEND}` + `{n.RECEIVE}` on `{n.ENGINE_CORE_TO_WORKER}`, per rank"),
    Stage(6, "forward + sample", "worker",
          "prepare inputs, forward over the paged KV cache, sample",
          "", f"`{n.WORKER_STEP}` (prepare_inputs, forward, sample), per rank"),
    Stage(7, "worker -> engine core", "worker -> engine core",
          "rank 0 returns the sampled token ids",
          "ModelRunnerOutput", f"`{n.SEND}` + `{n.RECEIVE}` on `{n.WORKER_TO_ENGINE_CORE}`"),
    Stage(8, "update", "engine core",
          "update_from_output(): append tokens, check EOS / stop ids / max_tokens",
          "", f"`{n.UPDATE}` of each step that served it"),
    Stage(9, "engine core -> API", "engine core -> API server",
          "the output thread sends token ids (never text)",
          "EngineCoreOutputs (ZMQ): token ids, finish reason",
          f"`{n.SEND}` + `{n.RECEIVE}` on `{n.ENGINE_CORE_TO_API}`"),
    Stage(10, "detokenize + stream out", "API server",
          "incremental detokenizer, stop strings, SSE chunks / JSON to the client",
          "", f"last `EngineCoreOutputs` received -> `{n.REQUEST}` end"),
)  # fmt: skip

STAGE_BY_BOUNDARY = {
    n.API_TO_ENGINE_CORE: 2,
    n.ENGINE_CORE_TO_WORKER: 5,
    n.WORKER_TO_ENGINE_CORE: 7,
    n.ENGINE_CORE_TO_API: 9,
}
STAGE_BY_SPAN = {n.SCHEDULE: 4, n.WORKER_STEP: 6, n.UPDATE: 8}

OCCURRENCE_COLUMNS = ["stage", "name", "start_ns", "end_ns", "step", "rank", "detail"]

# The schedule / worker-step / update spans of every step that served the request.
_STEP_PHASES = f"""
WITH served AS (
    SELECT DISTINCT s.trace_id, s.step
    FROM step_requests sr JOIN steps s ON {queries.STEP_JOIN}
    WHERE sr.request_id = $1
)
SELECT sp.name, served.step, sp.start_ns, sp.end_ns, sp.rank
FROM spans sp JOIN served ON sp.trace_id = served.trace_id
WHERE sp.name IN ('{n.SCHEDULE}', '{n.WORKER_STEP}', '{n.UPDATE}')
ORDER BY sp.start_ns
"""


_EVENTS = f"SELECT events FROM spans WHERE name = '{n.REQUEST}' AND span_id = $1 AND trace_id = $2"


def _int(value: Any) -> int | None:
    return None if value is None or pd.isna(value) else int(value)


def preemption_times(source: Any, request: dict[str, Any]) -> list[int]:
    """Times (ns) of the request span's `preempted` events."""
    frame = queries.df(source, _EVENTS, [request["span_id"], request["trace_id"]])
    if frame.empty or frame["events"].iloc[0] is None:
        return []
    events = frame["events"].iloc[0]
    events = json.loads(events) if isinstance(events, str) else events
    return sorted(int(e["time_ns"]) for e in events if e.get("name") == n.RequestEvent.PREEMPTED)


def stage_occurrences(source: Any, request_id: str) -> tuple[dict[str, Any], pd.DataFrame]:
    """The request's row (`requests` view) and one row per stage occurrence, in time order.

    A preempted request waits again: stage 3 then also runs from each `preempted` event to the
    start of the next step that served the request.
    """
    path = queries.request_path(source, request_id)
    request = path.request
    rows: list[dict[str, Any]] = []

    def add(stage: int, start: Any, end: Any, step: Any = None, rank: Any = None, detail=""):
        start, end = _int(start), _int(end)
        if start is not None and end is not None and end >= start:
            name = STAGES[stage - 1].name
            values = (stage, name, start, end, _int(step), _int(rank), detail)
            rows.append(dict(zip(OCCURRENCE_COLUMNS, values, strict=True)))

    crossings = path.crossings
    sends = crossings[crossings["side"] == "send"]
    receives = crossings[crossings["side"] == "receive"]
    first_send = None
    last_output_ns = None
    for send in sends.itertuples(index=False):
        stage = STAGE_BY_BOUNDARY.get(send.boundary)
        if stage is None:
            continue
        if stage == 2 and first_send is None:
            first_send = send.start_ns
        matched = receives[receives["parent_span_id"] == send.span_id]
        detail = f"{send.message_type}, {_int(send.bytes) or 0} B, {send.num_requests} req"
        if matched.empty:
            add(stage, send.start_ns, send.end_ns, send.step, send.rank, detail + ", no receive")
        for receive in matched.itertuples(index=False):
            rank = receive.rank if stage == 5 else send.rank
            add(stage, send.start_ns, receive.end_ns, send.step, rank, detail)
            if stage == 9:
                last_output_ns = max(last_output_ns or 0, _int(receive.end_ns) or 0)

    add(1, request["start_ns"], first_send if first_send is not None else request["queued_ns"])
    add(3, request["queued_ns"], request["scheduled_ns"])
    step_starts = sorted(int(t) for t in path.steps["start_ns"].dropna())
    for preempted_ns in preemption_times(source, request):
        later = [t for t in step_starts if t > preempted_ns]
        if later:
            add(3, preempted_ns, later[0], detail="waiting again after a preemption")
    phases = queries.df(source, _STEP_PHASES, [request_id])
    for phase in phases.itertuples(index=False):
        stage = STAGE_BY_SPAN[phase.name]
        add(stage, phase.start_ns, phase.end_ns, phase.step, phase.rank if stage == 6 else None)
    tail_start = last_output_ns or request["finished_ns"]
    add(10, tail_start, request["end_ns"])

    frame = pd.DataFrame(rows, columns=OCCURRENCE_COLUMNS)
    if not frame.empty:
        frame = frame.sort_values(["start_ns", "stage"], kind="stable").reset_index(drop=True)
    return request, frame


def stage_summary(occurrences: pd.DataFrame) -> pd.DataFrame:
    """One row per stage: where it runs, what crosses, how often, first and total time (ms)."""
    rows = []
    for stage in STAGES:
        mine = occurrences[occurrences["stage"] == stage.number]
        durations_ms = (mine["end_ns"] - mine["start_ns"]) / 1e6
        rows.append(
            {
                "stage": stage.number,
                "name": stage.name,
                "process": stage.process,
                "action": stage.action,
                "crosses": stage.crosses or "-",
                "times": len(mine),
                "first_ms": float(durations_ms.iloc[0]) if len(mine) else None,
                "total_ms": float(durations_ms.sum()) if len(mine) else None,
                "measured_by": stage.measured_by,
            }
        )
    return pd.DataFrame(rows)
