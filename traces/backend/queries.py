"""Questions asked of a trace, for the CLI, the dashboard and the tutorials.

Each function takes a `Queryable` (source.py: a trace file or a running collector opened as a
source, or a `TraceStore`) and reads only the views (`requests`, `steps`, `crossings`,
`step_requests`, `worker_steps`), so it works the same on a live run and on a finished file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from stepscope.traces import names as n
from stepscope.traces.backend.source import Queryable


def df(source: Queryable, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame:
    """Run `sql` on any trace source and return a DataFrame."""
    return source.df(sql, params)


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [
        {k: (None if _is_missing(v) else v) for k, v in row.items()}
        for row in frame.to_dict(orient="records")
    ]


def _is_missing(value: Any) -> bool:
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


# ---- one request --------------------------------------------------------------------------------
@dataclass(slots=True)
class RequestPath:
    """One request's way through the processes: its span, its crossings, the steps that ran it."""

    request: dict[str, Any]
    crossings: pd.DataFrame  # every send/receive of the four boundaries that carried it, in order
    steps: pd.DataFrame  # the engine steps that scheduled tokens for it, in order


# Step indexes count per data-parallel rank: a step is (dp_rank, step), never the index alone.
STEP_JOIN = "s.dp_rank = sr.dp_rank AND s.step = sr.step AND s.start_ns = sr.start_ns"

# The `steps` view plus each step's own time: from `own_start_ns` (its start, or the end of the
# latest earlier step of its rank where that is later) to its end, `own_s` seconds. Under async
# scheduling a step starts (is scheduled) while the one before it runs, so step spans overlap and
# their durations count that time twice; own times never count a moment twice, and a step that
# overlaps no other has its duration as its own time.
STEPS_WITH_OWN_TIME = """
SELECT *, greatest(0, end_ns - own_start_ns) / 1e9 AS own_s
FROM (
    SELECT *, greatest(start_ns, coalesce(max(end_ns) OVER (
               PARTITION BY dp_rank ORDER BY start_ns
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), start_ns)) AS own_start_ns
    FROM steps
)
"""

_REQUEST_STEPS = f"""
SELECT sr.step, sr.num_tokens, s.duration_s, s.own_s, s.num_running, s.num_waiting,
       s.num_decode_tokens, s.num_prefill_tokens, s.token_budget, s.kv_free_before,
       s.kv_free_after, s.num_preempted, sr.start_ns, sr.end_ns, s.trace_id, s.span_id,
       sr.dp_rank
FROM step_requests sr JOIN ({STEPS_WITH_OWN_TIME}) s ON {STEP_JOIN}
WHERE sr.request_id = $1
ORDER BY sr.start_ns
"""

# A request's crossings: those in its own trace (api->engine_core), those in the traces of the
# steps that served it (engine_core<->worker, and engine_core->api when sent inside the step), and
# those whose send names it in `stepscope.request_ids` (with their receives).
_REQUEST_CROSSINGS = f"""
WITH served AS (
    SELECT DISTINCT s.trace_id, s.step
    FROM step_requests sr JOIN steps s ON {STEP_JOIN}
    WHERE sr.request_id = $1
),
named AS (
    SELECT span_id FROM spans
    WHERE name = '{n.SEND}'
      AND list_contains(
          CAST(json_extract(attributes, '$."{n.REQUEST_IDS}"') AS VARCHAR[]), $1)
)
SELECT c.boundary, c.side, c.message_type, c.bytes, c.num_requests, served.step,
       c.start_ns, c.end_ns, (c.end_ns - c.start_ns) / 1e3 AS duration_us,
       c.service_name, c.rank, c.dp_rank, c.trace_id, c.span_id, c.parent_span_id
FROM crossings c LEFT JOIN served ON c.trace_id = served.trace_id
WHERE c.trace_id IN (SELECT trace_id FROM requests WHERE request_id = $1)
   OR served.trace_id IS NOT NULL
   OR c.span_id IN (SELECT span_id FROM named)
   OR c.parent_span_id IN (SELECT span_id FROM named)
ORDER BY c.start_ns, c.side DESC
"""


def _request_row(source: Queryable, request_id: str) -> dict[str, Any]:
    rows = _records(df(source, "SELECT * FROM requests WHERE request_id = $1", [request_id]))
    if not rows:
        raise KeyError(f"no request {request_id!r} in this trace")
    return rows[0]


def request_path(source: Queryable, request_id: str) -> RequestPath:
    """The request's span, its crossings over the four boundaries and the steps that served it."""
    return RequestPath(
        request=_request_row(source, request_id),
        crossings=df(source, _REQUEST_CROSSINGS, [request_id]),
        steps=df(source, _REQUEST_STEPS, [request_id]),
    )


def request_timings(source: Queryable, request_id: str) -> dict[str, Any]:
    """Queue time, TTFT, end-to-end time and the steps that served one request.

    A step that scheduled more than one token for the request counts as a prefill step (a chunk,
    or a recompute after preemption); a one-token step as a decode step. `step_time_s` sums those
    steps' own times (`STEPS_WITH_OWN_TIME`), which overlapping steps do not count twice.
    """
    request = _request_row(source, request_id)
    steps = df(source, _REQUEST_STEPS, [request_id])
    prefill = steps[steps["num_tokens"] > 1]
    return {
        "request_id": request_id,
        "queue_time_s": request["queue_time_s"],
        "ttft_s": request["ttft_s"],
        "e2e_s": request["e2e_s"],
        "input_tokens": request["input_tokens"],
        "output_tokens": request["output_tokens"],
        "cached_tokens": request["cached_tokens"],
        "num_preemptions": request["num_preemptions"],
        "finish_reason": request["finish_reason"],
        "dp_rank": request.get("dp_rank"),
        "num_steps": len(steps),
        "num_prefill_steps": len(prefill),
        "num_decode_steps": len(steps) - len(prefill),
        "scheduled_tokens": int(steps["num_tokens"].sum()) if len(steps) else 0,
        "first_step": int(steps["step"].iloc[0]) if len(steps) else None,
        "last_step": int(steps["step"].iloc[-1]) if len(steps) else None,
        "step_time_s": float(steps["own_s"].sum()) if len(steps) else 0.0,
    }


# ---- the whole trace ---------------------------------------------------------------------------
_SPAN_COUNTS = """
SELECT name, service_name, count(*) AS spans,
       avg(duration_ns) / 1e6 AS mean_ms,
       quantile_cont(duration_ns, 0.5) / 1e6 AS p50_ms,
       quantile_cont(duration_ns, 0.99) / 1e6 AS p99_ms
FROM spans GROUP BY name, service_name ORDER BY name, service_name
"""

_CROSSING_COUNTS = """
SELECT boundary, side, message_type, count(*) AS messages, sum(bytes) AS total_bytes,
       avg(bytes) AS mean_bytes, avg(num_requests) AS mean_requests,
       avg(end_ns - start_ns) / 1e3 AS mean_us,
       quantile_cont(end_ns - start_ns, 0.99) / 1e3 AS p99_us
FROM crossings GROUP BY boundary, side, message_type ORDER BY boundary, side DESC, message_type
"""

_STEP_STATS = """
SELECT count(*) AS steps,
       avg(duration_s) * 1e3 AS mean_ms,
       quantile_cont(duration_s, 0.5) * 1e3 AS p50_ms,
       quantile_cont(duration_s, 0.99) * 1e3 AS p99_ms,
       avg(num_decode_tokens) AS mean_decode_tokens,
       avg(num_prefill_tokens) AS mean_prefill_tokens,
       avg((num_decode_tokens + num_prefill_tokens) / nullif(token_budget, 0)) AS mean_budget_used,
       max(num_running) AS max_running,
       max(num_waiting) AS max_waiting,
       sum(num_preempted) AS preemptions,
       min(kv_free_after) AS min_kv_free
FROM steps
"""

_LATENCY = """
WITH m AS (
    SELECT 'queue_time_s' AS metric, queue_time_s AS v FROM requests
    UNION ALL SELECT 'ttft_s', ttft_s FROM requests
    UNION ALL SELECT 'e2e_s', e2e_s FROM requests
    UNION ALL SELECT 'step_s', duration_s FROM steps
)
SELECT metric, count(v) AS n, quantile_cont(v, 0.5) AS p50, quantile_cont(v, 0.9) AS p90,
       quantile_cont(v, 0.99) AS p99, max(v) AS max
FROM m GROUP BY metric
ORDER BY list_position(['queue_time_s', 'ttft_s', 'e2e_s', 'step_s'], metric)
"""


# One row per data-parallel rank: the requests routed to it and the steps it ran.
_RANK_STATS = """
WITH r AS (
    SELECT dp_rank, count(*) AS requests,
           CAST(sum(output_tokens) AS BIGINT) AS output_tokens,
           CAST(sum(input_tokens) AS BIGINT) AS input_tokens,
           quantile_cont(ttft_s, 0.5) * 1e3 AS p50_ttft_ms,
           quantile_cont(ttft_s, 0.99) * 1e3 AS p99_ttft_ms
    FROM requests GROUP BY dp_rank
),
s AS (
    SELECT dp_rank, count(*) AS steps,
           avg(duration_s) * 1e3 AS mean_step_ms,
           avg((num_decode_tokens + num_prefill_tokens) / nullif(token_budget, 0))
               AS mean_budget_used,
           max(num_running) AS max_running,
           max(num_waiting) AS max_waiting,
           CAST(sum(num_preempted) AS BIGINT) AS preemptions
    FROM steps GROUP BY dp_rank
),
d AS (  -- what the DP coordinator published: the load the API servers routed by
    SELECT dp_rank, count(*) AS publications,
           avg(num_waiting) AS published_waiting,
           avg(num_running) AS published_running,
           bool_or(lost) AS lost
    FROM dp_loads GROUP BY dp_rank
)
SELECT dp_rank,
       coalesce(r.requests, 0) AS requests,
       coalesce(r.output_tokens, 0) AS output_tokens,
       coalesce(r.input_tokens, 0) AS input_tokens,
       coalesce(s.steps, 0) AS steps,
       s.mean_step_ms, s.mean_budget_used, s.max_running, s.max_waiting,
       coalesce(s.preemptions, 0) AS preemptions,
       r.p50_ttft_ms, r.p99_ttft_ms,
       coalesce(d.publications, 0) AS publications,
       d.published_waiting, d.published_running,
       coalesce(d.lost, false) AS lost
FROM r FULL OUTER JOIN s USING (dp_rank) LEFT JOIN d USING (dp_rank)
ORDER BY dp_rank
"""

_DP_RANKS = """
SELECT dp_rank FROM steps UNION SELECT dp_rank FROM requests ORDER BY dp_rank
"""


def dp_ranks(source: Queryable) -> list[int]:
    """The data-parallel ranks that ran steps or were sent requests ([0] for one rank)."""
    return [int(r) for r in df(source, _DP_RANKS)["dp_rank"].dropna()]


def summary(source: Queryable) -> dict[str, pd.DataFrame]:
    """Counts per span name, per boundary and side, step statistics, latency percentiles, and
    the work of each data-parallel rank ("ranks": one row per `dp_rank`, with the DP
    coordinator's published load: mean waiting and running, and whether the rank was lost)."""
    return {
        "spans": df(source, _SPAN_COUNTS),
        "crossings": df(source, _CROSSING_COUNTS),
        "steps": df(source, _STEP_STATS),
        "latency": df(source, _LATENCY),
        "ranks": df(source, _RANK_STATS),
    }


def list_requests(source: Queryable, limit: int = 20) -> pd.DataFrame:
    """The most recent requests with their timings."""
    return df(
        source,
        "SELECT request_id, model, input_tokens, output_tokens, queue_time_s, ttft_s, e2e_s, "
        "finish_reason, dp_rank FROM requests ORDER BY start_ns DESC LIMIT $1",
        [limit],
    )
