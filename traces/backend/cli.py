"""The `stepscope trace ...` commands: `summary PATH` and `request PATH ID` as readable tables,
`explain PATH [ID]` and `slowest PATH` (why requests were slow), and `export PATH -o FILE`, a
timeline for Perfetto UI or chrome://tracing.

PATH is a finished trace file (opened read-only) or the URL of a running collector, each opened
by `source.open_trace`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import pandas as pd

from stepscope.traces.backend import explain, export, queries
from stepscope.traces.backend.source import TraceSource, open_trace
from stepscope.traces.backend.units import format_seconds, format_table

# Every table prints through `format_table`: times with their unit, four significant digits.
_table = format_table


def _section(out: TextIO, title: str, body: str) -> None:
    print(f"\n{title}\n{body}", file=out)


def trace_summary(path: str, out: TextIO | None = None) -> None:
    """Print span counts, crossings per boundary, step statistics and latency percentiles, and,
    with data parallelism, the work of each DP rank."""
    out = out or sys.stdout
    with open_trace(path) as source:
        tables = queries.summary(source)
        recent = queries.list_requests(source, limit=10)
    ranks = tables["ranks"]
    several = len(ranks) > 1
    print(f"trace {path}", file=out)
    _section(out, "spans per name and process", _table(tables["spans"]))
    _section(out, "crossings per boundary", _table(tables["crossings"]))
    title = "engine steps (all DP ranks)" if several else "engine steps"
    _section(out, title, _table(tables["steps"]))
    if several:
        _section(out, "work per DP rank", _table(ranks))
    _section(out, "latency percentiles", _table(tables["latency"], seconds=LATENCY_COLUMNS))
    if not several:
        recent = recent.drop(columns="dp_rank")
    _section(out, "latest requests", _table(recent))


LATENCY_COLUMNS = ("p50", "p90", "p99", "max")
_fmt_s = format_seconds


def trace_request(path: str, request_id: str, out: TextIO | None = None) -> int:
    """Print one request's timings, its crossings per boundary and the steps that served it.

    Returns 0, or 1 (with a message) when the trace has no such request.
    """
    out = out or sys.stdout
    with open_trace(path) as source:
        try:
            timings = queries.request_timings(source, request_id)
            path_ = queries.request_path(source, request_id)
        except KeyError as error:
            print(error.args[0], file=sys.stderr)
            return 1
        several = len(queries.dp_ranks(source)) > 1
    request = path_.request
    where = f"  DP rank {request['dp_rank']}" if several else ""
    print(
        f"request {request_id}  model {request['model']}  ({request['operation']}){where}",
        file=out,
    )
    print(
        f"  queue {_fmt_s(timings['queue_time_s'])}   TTFT {_fmt_s(timings['ttft_s'])}   "
        f"end-to-end {_fmt_s(timings['e2e_s'])}",
        file=out,
    )
    print(
        f"  tokens in {timings['input_tokens']} (cached {timings['cached_tokens']}), "
        f"out {timings['output_tokens']}, finish {timings['finish_reason']}, "
        f"preemptions {timings['num_preemptions']}",
        file=out,
    )
    print(
        f"  steps {timings['num_steps']} ({timings['num_prefill_steps']} prefill, "
        f"{timings['num_decode_steps']} decode), {timings['scheduled_tokens']} tokens scheduled",
        file=out,
    )

    crossings = path_.crossings
    per_boundary = pd.DataFrame()
    if not crossings.empty:
        start = request["start_ns"]
        per_boundary = (
            crossings.assign(at_ms=(crossings["start_ns"] - start) / 1e6)
            .groupby(["boundary", "side", "message_type"], sort=False)
            .agg(
                messages=("span_id", "count"),
                first_ms=("at_ms", "min"),
                last_ms=("at_ms", "max"),
                mean_bytes=("bytes", "mean"),
                mean_us=("duration_us", "mean"),
            )
            .reset_index()
        )
    _section(out, "crossings (times from request start)", _table(per_boundary))

    steps = path_.steps
    if not steps.empty:
        steps = steps.assign(
            at_ms=(steps["start_ns"] - request["start_ns"]) / 1e6,
            duration_ms=steps["duration_s"] * 1e3,
        )[
            [
                "step",
                "at_ms",
                "duration_ms",
                "num_tokens",
                "num_running",
                "num_waiting",
                "num_decode_tokens",
                "num_prefill_tokens",
                "kv_free_after",
            ]
        ]
    _section(out, "steps that served it", _table(steps))
    return 0


def trace_export(path: str, output: str, fmt: str = "chrome", out: TextIO | None = None) -> None:
    """Write the trace as a timeline file and say what it holds. `chrome`: Chrome trace-event
    JSON, which Perfetto UI (ui.perfetto.dev) and chrome://tracing open."""
    if fmt != "chrome":
        raise ValueError(f"unknown export format {fmt!r}: the one format is 'chrome'")
    trace = export.write_chrome(path, output)
    info = trace["otherData"]
    print(
        f"wrote {len(trace['traceEvents'])} events ({info['processes']} processes, "
        f"{info['requests']} requests, {info['steps']} engine steps) to {output}",
        file=out or sys.stdout,
    )


def trace_explain(
    path: str, request_id: str | None = None, as_json: bool = False, out: TextIO | None = None
) -> int:
    """Why one request (default: the slowest) took as long as it did: its end-to-end time split
    into parts that add up, the queue by reason, the steps it shared, and a sentence.

    Returns 0, or 1 (with a message) when the trace has no such request.
    """
    out = out or sys.stdout
    result = _ask(path, lambda source: explain.explain(source, request_id))
    if result is None:
        return 1
    if as_json:
        print(explain.to_json(result), file=out)
        return 0
    e2e = result["e2e_s"]
    print(f"request {result['request_id']}  end-to-end {_fmt_s(e2e)}  DP rank "
          f"{result['dp_rank']}", file=out)  # fmt: skip
    parts = pd.DataFrame(
        {
            "part": [p.removesuffix("_s") for p in explain.PARTS],
            "time_s": [result["parts"][p] for p in explain.PARTS],
            "share": [f"{result['parts'][p] / e2e:.0%}" if e2e else "-" for p in explain.PARTS],
        }
    )
    _section(out, "where the time went (in the request path's order; the parts add up)",
             _table(parts) + _startup_line(result["startup"]))  # fmt: skip
    if result["queue_reasons"]:
        reasons = pd.DataFrame(
            {
                "reason": list(result["queue_reasons"]),
                "time_s": list(result["queue_reasons"].values()),
            }
        )
        _section(out, "queue time by reason", _table(reasons))
    shared = result["shared"]
    _section(
        out,
        "the steps that ran it",
        f"  {shared['steps']} steps ({shared['prefill_steps']} prefill, "
        f"{shared['decode_steps']} decode), with {_other_requests(shared)} other requests; "
        f"its tokens {shared['own_tokens']}, others' {shared['other_prefill_tokens']} prefill + "
        f"{shared['other_decode_tokens']} decode (about {_fmt_s(shared['interference_s'])} of "
        "those steps' time)\n"
        f"  preemptions {result['preemptions']}, recomputed tokens "
        f"{result['recomputed_tokens']}, prefix-cache hits {result['prefix_hit_tokens']} tokens"
        + _cpu_line(result["cpu"]),
    )
    _section(out, "why", "  " + result["summary"])
    return 0


def _startup_line(start: dict | None) -> str:
    """The engine's own start, before any request reached it: not a part of this request's
    time, but what a user waited for first (Ray's share of it with the ray backend)."""
    if start is None:
        return ""
    text = f"\n  before the engine: it started in {_fmt_s(start['engine_start_s'])}"
    if start["ready_before_s"] is not None and start["ready_before_s"] >= 0:
        text += f", ready {_fmt_s(start['ready_before_s'])} before this request"
    if start["backend"] == "ray":
        ray = [
            f"{what} {_fmt_s(start[key])}"
            for key, what in (
                ("ray_connect_s", "the cluster"),
                ("ray_placement_s", "placement"),
                ("ray_actor_start_s", "the engine cores' actors"),
            )  # fmt: skip
            if start[key] is not None
        ]
        text += f"; Ray took {', '.join(ray)} of it"
    return text


def _ask(path: str, question: Callable[[TraceSource], Any]) -> Any:
    """`question` asked of the trace at `path`; None, with the message, when the trace has no
    such request."""
    with open_trace(path) as source:
        try:
            return question(source)
        except KeyError as error:
            print(error.args[0], file=sys.stderr)
            return None


def _cpu_line(cpu: dict) -> str:
    """The CPU its steps' worker got, measured, and whether that names a busy machine."""
    if cpu["cpu_share"] is None:
        return ""
    verdict = (
        "the machine was busy with something else"
        if cpu["contention"]
        else "no busy machine measured"
    )
    return (
        f"\n  worker CPU {_fmt_s(cpu['cpu_s'])} in {_fmt_s(cpu['worker_s'])} of its steps on "
        f"{cpu['num_threads']} threads: {cpu['cpu_share']:.0%} of what they could use, "
        f"{cpu['cpu_cores']:.2f} cores ({verdict})"
    )


def _other_requests(shared: dict) -> str:
    low, high = shared["other_requests_min"], shared["other_requests_max"]
    return str(low) if low == high else f"{low}-{high}"


def trace_slowest(path: str, limit: int = 10, out: TextIO | None = None) -> int:
    """The slowest requests, each with its largest part and that part's cause."""
    out = out or sys.stdout
    results = _ask(path, lambda source: explain.slowest(source, limit))
    if results is None:
        return 1
    rows = []
    for r in results:
        part, seconds = explain.largest_part(r)
        rows.append(
            {
                "request_id": r["request_id"],
                "e2e_s": r["e2e_s"],
                "largest": part.removesuffix("_s"),
                "time_s": seconds,
                "share": f"{seconds / r['e2e_s']:.0%}" if r["e2e_s"] else "-",
                "cause": explain.cause(r),
            }
        )
    print(f"the {len(rows)} slowest requests of {path}", file=out)
    _section(out, "", _table(pd.DataFrame(rows)))
    return 0
