"""`stepscope trace summary PATH` and `stepscope trace request PATH ID`, as readable tables.

PATH is a finished trace file (opened read-only) or the URL of a running collector.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import pandas as pd

from stepscope.traces import queries
from stepscope.traces.collector import CollectorClient
from stepscope.traces.store import TraceStore


@contextmanager
def open_trace(path: str) -> Iterator[queries.Source]:
    """A read-only view of a trace: a file, or a collector's URL while it runs."""
    if path.startswith(("http://", "https://")):
        yield CollectorClient(path)
        return
    store = TraceStore(path, read_only=True)
    try:
        yield store
    finally:
        store.close()


def _table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "  (none)"
    text = frame.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="-")
    return "\n".join("  " + line for line in text.splitlines())


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
    _section(out, "latency percentiles (seconds)", _table(tables["latency"]))
    if not several:
        recent = recent.drop(columns="dp_rank")
    _section(out, "latest requests", _table(recent))


def _fmt_s(value: Any) -> str:
    return "-" if value is None else f"{value * 1e3:.2f} ms"


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
