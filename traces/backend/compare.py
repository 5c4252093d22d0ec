"""Two runs side by side: the numbers a serving benchmark reports, per run and per request.

`run_table(requests)` turns per-request times into the run's table, with exactly the keys of
`METRICS`; a recorded run (`recorded_requests`, read from the views) and a predicted one
(viz/whatif.py) both go through it, so the two are computed the same way:

- TTFT (`first_token - start`) and end-to-end time (`end - start`): nearest-rank percentiles over
  the requests (the value at rank ceil(p/100 * N) of the N sorted ones);
- `tpot_mean_s`: the mean over requests with more than one output token of
  (finished - first token) / (output tokens - 1);
- `throughput_tok_s`: every request's output tokens over (last finish - first arrival);
- `preemptions`: summed over requests;
- `queue_s_by_reason`: each request's queue time split by the reason the steps recorded for the
  head of the waiting queue, explain's rule (`explain._queue_reasons`), summed over requests.

`compare(a, b)` reads both traces and adds the ratio B/A of every number and, paired, each
request's own numbers (`stepscope trace compare A B [--json]`).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
import pandas as pd

from stepscope.traces.backend.explain import _in_order, _queue_reasons
from stepscope.traces.backend.source import Queryable, open_trace
from stepscope.traces.backend.units import format_number, format_seconds
from stepscope.traces.backend.workload import check_one_run

METRICS = (
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "e2e_p50_s",
    "e2e_p90_s",
    "throughput_tok_s",
    "preemptions",
    "queue_s_by_reason",
)


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One request's moments (ns, any common origin) and what it did. `finished_ns` is the
    engine core's `finished` event; `end_ns` the request span's end (its last byte sent)."""

    request_id: str
    start_ns: int
    first_token_ns: int | None
    finished_ns: int
    end_ns: int
    output_tokens: int
    preemptions: int = 0
    queue_s_by_reason: dict[str, float] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_ns is None else (self.first_token_ns - self.start_ns) / 1e9

    @property
    def e2e_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_ns is None or self.output_tokens < 2:
            return None
        return (self.finished_ns - self.first_token_ns) / 1e9 / (self.output_tokens - 1)

    def row(self) -> dict[str, Any]:
        """This request's own numbers, for `compare --json`."""
        return {
            "request_id": self.request_id,
            "ttft_s": _round(self.ttft_s),
            "tpot_s": _round(self.tpot_s),
            "e2e_s": _round(self.e2e_s),
            "queue_s": _round(sum(self.queue_s_by_reason.values())),
            "output_tokens": self.output_tokens,
            "preemptions": self.preemptions,
        }


def nearest_rank(values: Sequence[float], percent: float) -> float | None:
    """The nearest-rank percentile: the ceil(percent/100 * N)-th smallest of N values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(math.ceil(percent / 100 * len(ordered)), 1)
    return ordered[rank - 1]


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(float(value), digits)


def run_table(requests: Sequence[RequestTimes]) -> dict[str, Any]:
    """The run's table (exactly the keys of METRICS) from its requests' times."""
    ttfts = [t for r in requests if (t := r.ttft_s) is not None]
    e2es = [r.e2e_s for r in requests]
    tpots = [t for r in requests if (t := r.tpot_s) is not None]
    span = 0.0
    if requests:
        span = (max(r.finished_ns for r in requests) - min(r.start_ns for r in requests)) / 1e9
    tokens = sum(r.output_tokens for r in requests)
    reasons: dict[str, float] = {}
    for r in requests:
        for reason, seconds in r.queue_s_by_reason.items():
            reasons[reason] = reasons.get(reason, 0.0) + seconds
    return {
        "ttft_p50_s": _round(nearest_rank(ttfts, 50)),
        "ttft_p90_s": _round(nearest_rank(ttfts, 90)),
        "ttft_p99_s": _round(nearest_rank(ttfts, 99)),
        "tpot_mean_s": _round(sum(tpots) / len(tpots)) if tpots else None,
        "e2e_p50_s": _round(nearest_rank(e2es, 50)),
        "e2e_p90_s": _round(nearest_rank(e2es, 90)),
        "throughput_tok_s": _round(tokens / span, 3) if span > 0 else None,
        "preemptions": sum(r.preemptions for r in requests),
        "queue_s_by_reason": {k: _round(v) for k, v in sorted(reasons.items())},
    }


# ---- a recorded run --------------------------------------------------------------------------
_REQUESTS = """
SELECT request_id, dp_rank, start_ns, end_ns, queued_ns, scheduled_ns, first_token_ns,
       finished_ns, coalesce(output_tokens, 0) AS output_tokens,
       coalesce(num_preemptions, 0) AS num_preemptions
FROM requests WHERE end_ns IS NOT NULL ORDER BY start_ns, request_id
"""
_STEPS = "SELECT dp_rank, start_ns, waiting_reason FROM steps ORDER BY dp_rank, start_ns"


def _int(value: Any) -> int | None:
    return None if value is None or pd.isna(value) else int(value)


class StepColumns:
    """A rank's steps as explain's queue rule reads them: `start_ns` (sorted) and
    `waiting_reason`, numpy arrays. A name gives a column; a mask or a slice the rows, as a
    DataFrame would, at a small part of pandas' cost (the rule runs once per request)."""

    __slots__ = ("columns",)

    def __init__(self, start_ns: Any, waiting_reason: Any) -> None:
        self.columns = {
            "start_ns": np.asarray(start_ns, dtype=np.int64),
            "waiting_reason": np.asarray(waiting_reason, dtype=object),
        }

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self.columns[key]
        return StepColumns(self.columns["start_ns"][key], self.columns["waiting_reason"][key])

    def __len__(self) -> int:
        return len(self.columns["start_ns"])


def queue_split(steps: StepColumns, queued_ns: int, scheduled_ns: int) -> dict[str, float]:
    """A request's queue time by reason, by explain's rule (`explain._queue_reasons`), from its
    rank's steps: only those that started while it waited are handed on."""
    starts = steps["start_ns"]
    lo, hi = starts.searchsorted(queued_ns, "left"), starts.searchsorted(scheduled_ns, "right")
    return _queue_reasons(steps[lo:hi], queued_ns, scheduled_ns)


def recorded_requests(source: Queryable, label: str = "this trace") -> list[RequestTimes]:
    """Every finished request of a trace, with its queue time by reason, from the views. A
    trace holding several runs raises ValueError (`workload.check_one_run`)."""
    check_one_run(source, label)
    frame = source.df(_REQUESTS)
    steps = source.df(_STEPS)
    by_rank = {
        int(rank): StepColumns(group["start_ns"], group["waiting_reason"])
        for rank, group in steps.groupby("dp_rank")
    }
    empty = StepColumns([], [])
    out = []
    for row in frame.itertuples(index=False):
        t0, t1 = int(row.start_ns), int(row.end_ns)
        queued, scheduled, first, finished = _in_order(
            t0, t1, _int(row.queued_ns), _int(row.scheduled_ns), _int(row.first_token_ns),
            _int(row.finished_ns),
        )  # fmt: skip
        reasons = queue_split(by_rank.get(int(row.dp_rank), empty), queued, scheduled)
        out.append(
            RequestTimes(
                request_id=str(row.request_id),
                start_ns=t0,
                first_token_ns=None if _int(row.first_token_ns) is None else first,
                finished_ns=finished,
                end_ns=t1,
                output_tokens=int(row.output_tokens),
                preemptions=int(row.num_preemptions),
                queue_s_by_reason=reasons,
            )
        )
    return out


def recorded_table(source: Queryable, label: str = "this trace") -> dict[str, Any]:
    """A recorded run's table, read from its views."""
    return run_table(recorded_requests(source, label))


# ---- two runs --------------------------------------------------------------------------------
def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """B/A for every number of two tables (None where A's is 0 or either is missing); queue
    time by reason per reason either run has."""

    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None or x == 0 else round(y / x, 4)

    out: dict[str, Any] = {k: ratio(a[k], b[k]) for k in METRICS if k != "queue_s_by_reason"}
    reasons = sorted(set(a["queue_s_by_reason"]) | set(b["queue_s_by_reason"]))
    out["queue_s_by_reason"] = {
        r: ratio(a["queue_s_by_reason"].get(r, 0.0), b["queue_s_by_reason"].get(r, 0.0))
        for r in reasons
    }
    return out


def pair_requests(
    a: Sequence[RequestTimes], b: Sequence[RequestTimes]
) -> list[tuple[RequestTimes | None, RequestTimes | None]]:
    """The same requests of two runs: by request id when both runs hold the same ids, else by
    order of arrival (a replay through a server gives its requests new ids)."""
    if {r.request_id for r in a} == {r.request_id for r in b}:
        by_id = {r.request_id: r for r in b}
        return [(r, by_id[r.request_id]) for r in a]
    pairs: list[tuple[RequestTimes | None, RequestTimes | None]] = list(zip(a, b, strict=False))
    pairs += [(r, None) for r in a[len(b) :]] + [(None, r) for r in b[len(a) :]]
    return pairs


def compare(
    a: Queryable, b: Queryable, labels: tuple[str, str] = ("trace A", "trace B")
) -> dict[str, Any]:
    """Both runs' tables, the ratio B/A, and each request's numbers in both runs (`labels`
    name the traces in errors)."""
    req_a, req_b = recorded_requests(a, labels[0]), recorded_requests(b, labels[1])
    table_a, table_b = run_table(req_a), run_table(req_b)
    return {
        "a": table_a,
        "b": table_b,
        "ratio": ratios(table_a, table_b),
        "requests": [
            {"a": x.row() if x else None, "b": y.row() if y else None}
            for x, y in pair_requests(req_a, req_b)
        ],
    }


def metric_text(key: str, value: Any) -> str:
    """One number of a table as people read it: times in s or ms, four significant digits."""
    if value is None:
        return "-"
    if key == "throughput_tok_s":
        return f"{format_number(float(value))} tok/s"
    if key.endswith("_s"):
        return format_seconds(value)
    return format_number(value)


def table_rows(tables: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(label, one text per table) for each number, queue time by reason last, one row per
    reason any table has."""
    rows = []
    for key in METRICS[:-1]:
        label = "throughput" if key == "throughput_tok_s" else key.removesuffix("_s")
        rows.append((label, [metric_text(key, t[key]) for t in tables]))
    reasons = sorted({r for t in tables for r in t["queue_s_by_reason"]})
    for reason in reasons:
        rows.append(
            (
                f"queue: {reason}",
                [format_seconds(t["queue_s_by_reason"].get(reason, 0.0)) for t in tables],
            )
        )
    return rows


def aligned(header: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]]) -> str:
    """Rows of texts as a table: the label left, every other column right-aligned."""
    cells = [list(header), *[[label, *texts] for label, texts in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  "
        + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row))
        for row in cells
    ]
    return "\n".join(line.rstrip() for line in lines)


def trace_compare(
    path_a: str, path_b: str, as_json: bool = False, out: TextIO | None = None
) -> int:
    """`stepscope trace compare A B`: both runs' tables side by side with the ratio B/A; with
    `as_json`, the tables, the ratios and each request's numbers as JSON."""
    out = out or sys.stdout
    with open_trace(path_a) as a, open_trace(path_b) as b:
        result = compare(a, b, (path_a, path_b))
    if as_json:
        print(json.dumps(result, indent=2), file=out)
        return 0
    rows = table_rows([result["a"], result["b"]])
    ratio = result["ratio"]
    keys = [*METRICS[:-1], *(f"queue:{r}" for r in sorted(ratio["queue_s_by_reason"]))]
    texts = []
    for (label, pair), key in zip(rows, keys, strict=True):
        value = (
            ratio["queue_s_by_reason"].get(key.partition(":")[2])
            if key.startswith("queue:")
            else ratio[key]
        )
        texts.append((label, [*pair, "-" if value is None else format_number(value)]))
    print(f"A {path_a} ({len(result['requests'])} requests paired)\nB {path_b}", file=out)
    print(aligned(["", "A", "B", "B/A"], texts), file=out)
    return 0
