"""Why was this request slow: one request's end-to-end time split into parts that add up.

`explain(source, request_id)` reads the views of a trace (a finished file or a running collector)
and returns the answer as plain data; `stepscope trace explain`, `stepscope trace slowest` and the
dashboard's request page all call it. The parts follow the request path's stage order, from the
request span's start `t0` to its end `t1`, with the times the engine core reported as events:

    t0 --before_engine--> queued --queue--> scheduled --prefill--> first_token --decode-->
       finished --after_engine--> t1

and every interval from a preemption to the end of the request's recompute moved out of prefill
and decode into `preempted_s`. So the parts add up to `t1 - t0` by construction (times are
clamped into order first, for a trace whose processes' clocks disagree).

The queue is split by reason. The engine admits new requests only between steps: from the
request's arrival to the first step that considered it, it waited for the running step
(`arrived_during_step`); from each step's start to the next, it waited for the reason that step
recorded for the head of the waiting queue (first come, first served: the head's reason holds
back everyone behind it). Steps not traced (`--trace-steps every:N`) leave `unknown`. A
structured request waits for its grammar to compile first (`grammar`, from its arrival to its
`grammar_ready` event, whatever the steps meanwhile recorded for the head of the queue); the
rule above takes over from there.

Interference is estimated by each step's own token mix: a step that ran T tokens, o of them
other requests', spent o/T of its time on them. On a CPU every token costs about the same in the
linear layers, which dominate; attention makes a long prefill's tokens somewhat dearer.

Steps may overlap: with async scheduling a step starts (is scheduled) while the step before it
still runs. The parts above come from the request's own events and add up all the same; what is
summed over steps (interference, a step's time in the summary) takes each step's own time, from
the end of the step before it (`queries.STEPS_WITH_OWN_TIME`), so that no moment counts twice.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from stepscope.traces import names as n
from stepscope.traces.backend.queries import (
    STEP_JOIN,
    STEPS_WITH_OWN_TIME,
    _records,
    _request_row,
    df,
)
from stepscope.traces.backend.source import Queryable
from stepscope.traces.backend.units import format_seconds
from stepscope.traces.backend.views import _num, _str, dp_rank_sql

PARTS = ("before_engine_s", "queue_s", "prefill_s", "decode_s", "preempted_s", "after_engine_s")
ARRIVED_DURING_STEP = "arrived_during_step"
GRAMMAR = "grammar"  # waited for its grammar to compile (structured outputs)
UNKNOWN = "unknown"
# The machine, not the requests beside it, slowed a request's steps when their worker got under
# half the CPU time its threads could have used AND under three quarters of one core. A CPU-bound
# step keeps at least one thread running from start to end; the share alone would misjudge steps
# whose small matmuls run on one thread (the tiny model uses 50% of 2 threads, about one core,
# unhindered; far less of 16).
CONTENTION_SHARE = 0.5
CONTENTION_CORES = 0.75


def contended(cpu_s: Any, worker_s: Any, thread_s: Any) -> Any:
    """The contention rule: the worker's CPU time `cpu_s` under CONTENTION_SHARE of what its
    threads could have used (`thread_s`: wall time x threads) and under CONTENTION_CORES of its
    wall time `worker_s`. Floats, or numpy arrays element by element (NaN: not contended)."""
    return (cpu_s < CONTENTION_SHARE * thread_s) & (cpu_s < CONTENTION_CORES * worker_s)


# When the request was preempted: the starts of the steps that preempted it (each names them);
# with those steps not traced, the request span's event (it carries the last preemption only).
_PREEMPTIONS = f"""
SELECT 0 AS source, start_ns AS time_ns FROM spans
WHERE name = '{n.ENGINE_STEP}' AND {dp_rank_sql()} = $2
  AND list_contains(CAST(json_extract(attributes, '$."{n.PREEMPTED_IDS}"') AS VARCHAR[]), $1)
UNION ALL
SELECT 1 AS source, CAST(json_extract(e, '$.time_ns') AS BIGINT) AS time_ns
FROM (SELECT unnest(CAST(events AS JSON[])) AS e FROM spans WHERE span_id = $3)
WHERE json_extract_string(e, '$.name') = '{n.RequestEvent.PREEMPTED}'
"""

# Every step of the request's rank from its arrival to its end, with how many requests each ran
# and how many tokens it ran for this one (0: it waited through that step).
_STEPS = f"""
WITH counts AS (
    SELECT dp_rank, step, start_ns, count(*) AS num_requests,
           sum(num_tokens) FILTER (WHERE request_id = $1) AS own_tokens
    FROM step_requests WHERE dp_rank = $2 AND end_ns >= $3 AND start_ns <= $4
    GROUP BY dp_rank, step, start_ns
)
SELECT s.step, s.start_ns, s.end_ns, s.own_start_ns, s.own_s, s.num_prefill_tokens,
       s.num_decode_tokens, s.cpu_s, s.worker_s, s.num_threads,
       s.waiting_reason, s.kv_blocks_short, s.token_budget,
       coalesce(sr.num_requests, 0) AS num_requests, coalesce(sr.own_tokens, 0) AS own_tokens
FROM ({STEPS_WITH_OWN_TIME}) s LEFT JOIN counts sr ON {STEP_JOIN}
WHERE s.dp_rank = $2 AND s.end_ns >= $3 AND s.start_ns <= $4
ORDER BY s.start_ns
"""


# The engine's start, as its launcher recorded it (the first, for a trace of several runs), and
# what Ray's actors took of it: the slowest engine core's, as the ranks start together.
_STARTUP = f"""
WITH start AS (
    SELECT span_id, start_ns, end_ns, {_str(n.BACKEND)} AS backend,
           {_num(n.RAY_CONNECT_S, "DOUBLE")} AS ray_connect_s
    FROM spans WHERE name = '{n.ENGINE_START}' ORDER BY start_ns LIMIT 1
)
SELECT start.start_ns, start.end_ns, start.backend, start.ray_connect_s,
       max({_num(n.RAY_PLACEMENT_S, "DOUBLE", "p.attributes")}) AS ray_placement_s,
       max({_num(n.RAY_ACTOR_START_S, "DOUBLE", "p.attributes")}) AS ray_actor_start_s
FROM start LEFT JOIN spans p ON p.parent_span_id = start.span_id
     AND p.name = '{n.PROCESS_START}'
     AND {_str(n.ROLE, "p.attributes")} = 'engine_core'
GROUP BY ALL
"""


def startup(source: Queryable, before_ns: int | None = None) -> dict[str, Any] | None:
    """The engine's start, if the trace recorded it: seconds in all, how its cores started
    (process or ray), Ray's cluster connect, placement and actor start (None without Ray), and
    how long before `before_ns` (a request's start) the engine was ready."""
    rows = df(source, _STARTUP)
    if not len(rows):
        return None
    row = rows.iloc[0]

    def seconds(value: Any) -> float | None:
        return None if pd.isna(value) else round(float(value), 6)

    return {
        "engine_start_s": round((row["end_ns"] - row["start_ns"]) / 1e9, 6),
        "backend": row["backend"],
        "ray_connect_s": seconds(row["ray_connect_s"]),
        "ray_placement_s": seconds(row["ray_placement_s"]),
        "ray_actor_start_s": seconds(row["ray_actor_start_s"]),
        "ready_before_s": None
        if before_ns is None
        else round((before_ns - row["end_ns"]) / 1e9, 6),
    }


def explain(source: Queryable, request_id: str | None = None) -> dict[str, Any]:
    """Why request `request_id` (default: the slowest by end-to-end time) took as long as it did.

    Returns exactly: request_id, e2e_s, parts, queue_reasons, shared, cpu, preemptions,
    recomputed_tokens, prefix_hit_tokens, dp_rank, startup, summary. Raises KeyError for an
    unknown id. `startup` is the engine's own start before the request's (`startup()`), apart
    from the parts: a request reaches an engine that has started.
    """
    if request_id is None:
        request_id = _slowest_ids(source, 1)[0]
    request = _request_row(source, request_id)
    t0, t1 = request["start_ns"], request["end_ns"]
    queued, scheduled, first, finished = _in_order(
        t0, t1, request["queued_ns"], request["scheduled_ns"], request["first_token_ns"],
        request["finished_ns"],
    )  # fmt: skip
    preempted_at = _preemptions(source, request)
    steps = df(source, _STEPS, [request_id, request["dp_rank"], queued, finished])
    recompute = _recompute_intervals(steps, preempted_at, scheduled, finished)
    preempted_s = sum(b - a for a, b in recompute) / 1e9
    parts = {
        "before_engine_s": (queued - t0) / 1e9,
        "queue_s": (scheduled - queued) / 1e9,
        "prefill_s": (first - scheduled - _overlap(recompute, scheduled, first)) / 1e9,
        "decode_s": (finished - first - _overlap(recompute, first, finished)) / 1e9,
        "preempted_s": preempted_s,
        "after_engine_s": (t1 - finished) / 1e9,
    }
    input_tokens = request["input_tokens"] or 0
    output_tokens = request["output_tokens"] or 0
    cached = request["cached_tokens"] or 0
    served = steps[steps["own_tokens"] > 0]
    expected = input_tokens - cached + max(output_tokens - 1, 0)
    result: dict[str, Any] = {
        "request_id": request_id,
        "e2e_s": (t1 - t0) / 1e9,
        "parts": parts,
        "queue_reasons": _queue_reasons(steps, queued, scheduled, request.get("grammar_ready_ns")),
        "shared": _shared(served, first, input_tokens - cached, scheduled, finished),
        "cpu": _cpu(served),
        "preemptions": int(request["num_preemptions"] or 0),
        "recomputed_tokens": max(int(served["own_tokens"].sum()) - expected, 0)
        if len(served)
        else 0,
        "prefix_hit_tokens": int(cached),
        "dp_rank": int(request["dp_rank"] or 0),
        "startup": startup(source, t0),
        "summary": "",
    }
    result["summary"] = _summary(result, steps, queued, input_tokens, output_tokens)
    result["e2e_s"] = round(result["e2e_s"], 6)
    result["parts"] = {k: round(v, 6) for k, v in parts.items()}
    result["queue_reasons"] = {k: round(v, 6) for k, v in result["queue_reasons"].items()}
    result["shared"]["interference_s"] = round(result["shared"]["interference_s"], 6)
    return result


def slowest(source: Queryable, limit: int = 10) -> list[dict[str, Any]]:
    """The slowest requests by end-to-end time, each explained."""
    return [explain(source, rid) for rid in _slowest_ids(source, limit)]


def _slowest_ids(source: Queryable, limit: int) -> list[str]:
    rows = _records(
        df(
            source,
            "SELECT request_id FROM requests WHERE e2e_s IS NOT NULL "
            "ORDER BY e2e_s DESC, request_id LIMIT $1",
            [int(limit)],
        )
    )
    if not rows:
        raise KeyError("this trace holds no finished request")
    return [r["request_id"] for r in rows]


def largest_part(result: dict[str, Any]) -> tuple[str, float]:
    name = max(PARTS, key=lambda p: result["parts"][p])
    return name, result["parts"][name]


def cause(result: dict[str, Any]) -> str:
    """The cause of the largest part, in a few words (for `stepscope trace slowest`)."""
    part, _ = largest_part(result)
    shared = result["shared"]
    if part == "queue_s":
        return max(result["queue_reasons"], key=result["queue_reasons"].get, default=UNKNOWN)
    if part in ("prefill_s", "decode_s"):
        if result["cpu"]["contention"]:
            cpu = result["cpu"]
            return (f"machine busy (its worker got {cpu['cpu_share']:.0%} of its threads' CPU, "
                    f"{cpu['cpu_cores']:.2f} of a core)")  # fmt: skip
        if not shared["other_requests_max"]:
            return "ran alone"
        return (f"shared with {_range(shared['other_requests_min'], shared['other_requests_max'])}"
                f" others ({_ms(shared['interference_s'])} on their tokens)")  # fmt: skip
    if part == "preempted_s":
        return (f"{_plural(result['preemptions'], 'preemption')}, "
                f"{result['recomputed_tokens']} tokens recomputed")  # fmt: skip
    return "outside the engine core"


def to_json(result: dict[str, Any] | list[dict[str, Any]]) -> str:
    return json.dumps(result, indent=2)


def _preemptions(source: Queryable, request: dict[str, Any]) -> list[int]:
    found = df(
        source, _PREEMPTIONS, [request["request_id"], request["dp_rank"], request["span_id"]]
    )
    from_steps = found[found["source"] == 0]
    return sorted(int(t) for t in (from_steps if len(from_steps) else found)["time_ns"])


# ---- the parts ----------------------------------------------------------------------------------
def _in_order(t0: int, t1: int, *times: int | None) -> list[int]:
    """The engine core's event times, missing ones filled and all clamped into [t0, t1] and
    into order (an aborted request may lack `first_token`; clocks of two machines may differ)."""
    out, last = [], t0
    for value in times:
        value = last if value is None else min(max(int(value), last), t1)
        out.append(value)
        last = value
    return out


def _recompute_intervals(
    steps: pd.DataFrame, preempted_at: list[int], start: int, end: int
) -> list[tuple[int, int]]:
    """For each preemption: from it to the end of the recompute, i.e. the last step of the run of
    multi-token steps that re-admitted the request (or its first step after, if untraced)."""
    intervals = []
    for p in preempted_at:
        p = min(max(int(p), start), end)
        after = steps[(steps["start_ns"] >= p) & (steps["own_tokens"] > 0)]
        stop = end
        if len(after):
            stop = int(after["end_ns"].iloc[0])
            for tokens, step_end in zip(after["own_tokens"], after["end_ns"], strict=True):
                if tokens <= 1:
                    break
                stop = int(step_end)
        if intervals and p < intervals[-1][1]:  # preempted again while recomputing
            p = intervals[-1][1]
        if min(stop, end) > p:
            intervals.append((p, min(stop, end)))
    return intervals


def _overlap(intervals: list[tuple[int, int]], start: int, end: int) -> int:
    return sum(max(0, min(b, end) - max(a, start)) for a, b in intervals)


def _queue_reasons(
    steps: pd.DataFrame, queued: int, scheduled: int, grammar_ready: Any = None
) -> dict[str, float]:
    """Seconds of the queue time per reason (see the module docstring)."""
    reasons: dict[str, float] = {}
    if scheduled <= queued:
        return reasons
    if grammar_ready is not None and not pd.isna(grammar_ready):
        ready = min(max(int(grammar_ready), queued), scheduled)
        if ready > queued:
            reasons[GRAMMAR] = (ready - queued) / 1e9
        queued = ready
        if scheduled <= queued:
            return reasons
    considered = steps[(steps["start_ns"] >= queued) & (steps["start_ns"] <= scheduled)]
    starts = [int(s) for s in considered["start_ns"]]
    labels = [r if isinstance(r, str) else UNKNOWN for r in considered["waiting_reason"]]
    if not starts:
        reasons[UNKNOWN] = (scheduled - queued) / 1e9
        return reasons

    def add(reason: str, a: int, b: int) -> None:
        if b > a:
            reasons[reason] = reasons.get(reason, 0.0) + (b - a) / 1e9

    add(ARRIVED_DURING_STEP, queued, starts[0])
    # Each step's start to the next one's: the reason that step recorded. The admitting step's
    # own scheduling (its start to `scheduled`) goes with the wait before it.
    previous = ARRIVED_DURING_STEP
    for i, start in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else scheduled
        if i + 1 == len(starts):  # the step that admitted it
            add(previous, start, stop)
        else:
            add(labels[i], start, stop)
            previous = labels[i]
    return reasons


def _shared(
    served: pd.DataFrame, first_token: int, prompt_tokens: int, scheduled: int, finished: int
) -> dict[str, Any]:
    """The steps that ran the request: its tokens, the other requests' tokens, and the share of
    those steps' own time, from `scheduled` to `finished`, that went to the others (by each
    step's token mix). (Under async scheduling a step may run a token of the request after it
    stopped, to be thrown away: that step's time past `finished` is not the request's.)

    A one-token step is a decode once the prompt's `prompt_tokens` (less prefix hits) have run:
    it started after the first token, or (async scheduling) was scheduled while the step that
    would sample it still ran."""
    own = other_prefill = other_decode = 0
    decode_steps = prefill_steps = 0
    interference = 0.0
    others: list[int] = []
    for row in served.itertuples():
        mine = int(row.own_tokens)
        is_decode = mine == 1 and (row.start_ns >= first_token or own >= prompt_tokens)
        decode_steps += is_decode
        prefill_steps += not is_decode
        total = int(row.num_prefill_tokens) + int(row.num_decode_tokens)
        prefill_others = int(row.num_prefill_tokens) - (0 if is_decode else mine)
        decode_others = int(row.num_decode_tokens) - (1 if is_decode else 0)
        own += mine
        other_prefill += max(prefill_others, 0)
        other_decode += max(decode_others, 0)
        if total:
            own_ns = min(row.end_ns, finished) - max(row.own_start_ns, scheduled)
            interference += max(own_ns, 0) / 1e9 * max(total - mine, 0) / total
        others.append(int(row.num_requests) - 1)
    return {
        "steps": len(served),
        "prefill_steps": prefill_steps,
        "decode_steps": decode_steps,
        "own_tokens": own,
        "other_prefill_tokens": other_prefill,
        "other_decode_tokens": other_decode,
        "interference_s": interference,
        "other_requests_min": min(others, default=0),
        "other_requests_max": max(others, default=0),
    }


def _cpu(served: pd.DataFrame) -> dict[str, Any]:
    """The CPU the steps that ran the request got: their rank-0 worker's process CPU time
    (`cpu_s`) against its wall time (`worker_s`) times the threads its forward could use, summed
    over the steps that recorded all three (a GPU worker records no threads). `cpu_share` is the
    CPU time over wall time x threads, `cpu_cores` over wall time (the cores' worth it got);
    both None when no step recorded them. `contention`: both under their limits above."""
    known = served.dropna(subset=["cpu_s", "worker_s", "num_threads"])
    capacity = float((known["worker_s"] * known["num_threads"]).sum()) if len(known) else 0.0
    if capacity <= 0:
        return {"steps": 0, "cpu_s": None, "worker_s": None, "num_threads": None,
                "cpu_share": None, "cpu_cores": None, "contention": False}  # fmt: skip
    cpu_s, worker_s = float(known["cpu_s"].sum()), float(known["worker_s"].sum())
    return {
        "steps": len(known),
        "cpu_s": round(cpu_s, 6),
        "worker_s": round(worker_s, 6),
        "num_threads": int(known["num_threads"].max()),
        "cpu_share": round(cpu_s / capacity, 4),
        "cpu_cores": round(cpu_s / worker_s, 4),
        "contention": bool(contended(cpu_s, worker_s, capacity)),
    }


# ---- the sentence -------------------------------------------------------------------------------
_ms = format_seconds


def _range(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _step_words(step: Any) -> str:
    """What a step ran: 'step 0, which ran 62 prefill tokens in 285 ms' (its own time)."""
    work = []
    if step.num_prefill_tokens:
        work.append(f"{int(step.num_prefill_tokens)} prefill tokens")
    if step.num_decode_tokens:
        work.append(_plural(int(step.num_decode_tokens), "decode"))
    ran = " and ".join(work) or "no tokens"
    cold = " (the engine's first step)" if step.step == 0 else ""
    return f"step {int(step.step)}{cold}, which ran {ran} in {_ms(step.own_s)}"


def _busy_words(cpu: dict[str, Any], again: bool = False) -> str:
    """What was measured when the steps got too little CPU ('' when they did not); `again`: the
    sentence before said it already."""
    if not cpu["contention"]:
        return ""
    if again:
        return "on the same busy machine"
    threads = _plural(cpu["num_threads"], "thread")
    return (f"slowed by the machine, which was busy with something else: its worker got "
            f"{cpu['cpu_share']:.0%} of the CPU time its {threads} could have used in those "
            f"steps ({cpu['cpu_cores']:.2f} of a core, measured), so the steps were slow, not "
            "the requests beside it")  # fmt: skip


def _part_sentence(
    name: str,
    r: dict[str, Any],
    steps: pd.DataFrame,
    queued: int,
    inputs: int,
    outputs: int,
    again: bool = False,
) -> str:
    seconds = r["parts"][name]
    share = f"{_ms(seconds)} ({seconds / r['e2e_s']:.0%})" if r["e2e_s"] > 0 else _ms(seconds)
    shared = r["shared"]
    if name == "queue_s":
        reason = max(r["queue_reasons"], key=r["queue_reasons"].get, default=UNKNOWN)
        if reason == ARRIVED_DURING_STEP:
            running = steps[(steps["start_ns"] <= queued) & (steps["end_ns"] >= queued)]
            behind = f"behind {_step_words(running.iloc[0])}" if len(running) else "behind a step"
            return (f"waited {share} in the queue {behind}: the engine admits new requests "
                    "only between steps")  # fmt: skip
        waits = {
            "budget": "the token budget was used up by the requests ahead of it",
            "max_num_seqs": "the running batch was full (max_num_seqs)",
            "kv_blocks": "the KV cache had too few free blocks"
            + (f" (short by up to {int(steps['kv_blocks_short'].max())})" if len(steps) else ""),
            "preempted": "a preempted request ahead of it waited to be recomputed",
            GRAMMAR: "its grammar was compiling (structured outputs)",
            UNKNOWN: "of steps not in the trace",
        }
        return f"waited {share} in the queue because {waits.get(reason, reason)}"
    busy = _busy_words(r["cpu"], again)
    if name == "prefill_s":
        chunks = shared["prefill_steps"]
        if busy:
            return (f"spent {share} in prefill: {inputs - r['prefix_hit_tokens']} prompt tokens "
                    f"in {_plural(chunks, 'step')}, {busy}")  # fmt: skip
        return (f"spent {share} in prefill: {inputs - r['prefix_hit_tokens']} prompt tokens in "
                f"{_plural(chunks, 'step')}, sharing them with "
                f"{shared['other_prefill_tokens'] + shared['other_decode_tokens']} tokens of "
                "other requests")  # fmt: skip
    if name == "decode_s":
        text = f"spent {share} decoding {_plural(outputs, 'token')}"
        if busy:
            text += f" in {_plural(shared['decode_steps'], 'step')}, {busy}"
        elif shared["decode_steps"] and not shared["other_requests_max"]:
            text += f" in {shared['decode_steps']} steps of its own"
        elif shared["decode_steps"]:
            text += (f" in {shared['decode_steps']} steps shared with "
                     f"{_range(shared['other_requests_min'], shared['other_requests_max'])} "
                     f"others (about {_ms(shared['interference_s'])} of the time of the steps "
                     "that ran it went to their tokens)")  # fmt: skip
        return text
    if name == "preempted_s":
        return (f"was preempted {_plural(r['preemptions'], 'time')}: {share} waiting to be "
                f"re-admitted and recomputing {r['recomputed_tokens']} tokens")  # fmt: skip
    if name == "before_engine_s":
        return f"spent {share} before the engine core had it (HTTP, tokenizing, the send)"
    return f"spent {share} after its last token (the last output's way back and the response)"


def _summary(r: dict[str, Any], steps: pd.DataFrame, queued: int, inputs: int, outputs: int) -> str:
    """One or two plain sentences: the largest part and its cause, then the next if it counts."""
    ranked = sorted(PARTS, key=lambda p: r["parts"][p], reverse=True)
    first = _part_sentence(ranked[0], r, steps, queued, inputs, outputs)
    text = f"{r['request_id']} took {_ms(r['e2e_s'])}: it {first}."
    second = ranked[1]
    if r["e2e_s"] > 0 and r["parts"][second] / r["e2e_s"] >= 0.15:
        again = {ranked[0], second} <= {"prefill_s", "decode_s"}
        text += f" Then it {_part_sentence(second, r, steps, queued, inputs, outputs, again)}."
    return text
