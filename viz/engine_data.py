"""The engine page's data (dashboard page 3): its SQL over the `steps`, `requests`, `crossings`
and `dp_loads` views, and the shaping of what they return into the columns the page's charts,
tables and readouts show.

No Panel or Bokeh here: every function takes a trace source or frames and returns frames,
arrays, dicts and text, so the page's numbers are tested on a trace file alone
(tests/viz/test_engine_data.py). Step indexes count per data-parallel rank: a step is
(dp_rank, step).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from stepscope.traces import names as n
from stepscope.viz.frames import float_columns, fmt_ms, int_text

if TYPE_CHECKING:
    from stepscope.traces.backend.source import TraceSource

TIMELINE_STEPS = 40  # steps shown in the process timeline at once
MAX_STEPS = 5000  # steps read per refresh (the most recent)
MAX_REQUESTS = 5000
MAX_LOADS = 20_000  # DP coordinator rows read per refresh (the most recent)
# One colour per DP rank: Bokeh's Category10 palette, spelled out to keep Bokeh out of here.
RANK_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
# The per-step charts' columns, one value per step of the shown rank.
STEP_COLUMNS = (
    "step",
    "decode",
    "prefill",
    "budget",
    "used",
    "free",
    "total",
    "running",
    "waiting",
    "preempted",
    "hits",
    "duration_ms",
)

LATENCIES = ("ttft", "itl", "e2e")  # the latency histograms, by their `<key>_s` columns
# The numbers of a step the per-step and per-rank charts draw, as `float_columns` reads them.
_STEP_NUMBERS = [
    "step",
    "start_ns",
    "num_decode_tokens",
    "num_prefill_tokens",
    "token_budget",
    "kv_free_after",
    "kv_total_blocks",
    "num_running",
    "num_waiting",
    "num_preempted",
    "prefix_hit_tokens",
    "duration_s",
]

# ---- queries -----------------------------------------------------------
_STEPS_SQL = f"""
SELECT * FROM (
    SELECT step, start_ns, end_ns, duration_s, num_running, num_waiting, num_decode_tokens,
           num_prefill_tokens, token_budget, kv_free_before, kv_free_after, kv_total_blocks,
           prefix_hit_tokens, num_preempted, num_finished, dp_rank, kv_blocks_by_group,
           kv_group_windows
    FROM steps ORDER BY start_ns DESC LIMIT {MAX_STEPS}
) ORDER BY start_ns
"""
_REQUESTS_SQL = f"""
SELECT request_id, start_ns, input_tokens, output_tokens, cached_tokens, num_preemptions,
       queue_time_s, ttft_s, e2e_s, finish_reason, dp_rank
FROM requests WHERE request_id IS NOT NULL ORDER BY start_ns DESC LIMIT {MAX_REQUESTS}
"""
# A step span's data-parallel rank, as the views read it (docs/tracing.md): its process's.
_SPAN_DP_RANK = (
    f"""coalesce(CAST(json_extract(attributes, '$."{n.DP_RANK}"') AS INTEGER), """
    f"""CAST(json_extract(resource, '$."{n.DP_RANK}"') AS INTEGER), 0)"""
)
_TIMELINE_SPANS_SQL = f"""
SELECT name, service_name, rank, start_ns, end_ns,
       CAST(json_extract(attributes, '$."{n.STEP}"') AS BIGINT) AS step,
       {_SPAN_DP_RANK} AS dp_rank
FROM spans
WHERE name IN ('{n.ENGINE_STEP}', '{n.WORKER_STEP}') AND start_ns BETWEEN $1 AND $2
"""
_TIMELINE_CROSSINGS_SQL = """
WITH c AS (SELECT * FROM crossings WHERE start_ns BETWEEN $1 AND $2)
SELECT s.boundary, s.message_type, s.bytes, s.num_requests, s.start_ns AS send_ns,
       r.end_ns AS recv_ns, s.service_name AS src_service, s.rank AS src_rank,
       s.dp_rank AS src_dp_rank, r.service_name AS dst_service, r.rank AS dst_rank,
       r.dp_rank AS dst_dp_rank
FROM c s JOIN c r ON r.parent_span_id = s.span_id AND r.trace_id = s.trace_id
WHERE s.side = 'send' AND r.side = 'receive'
"""
_LOADS_SQL = f"""
SELECT * FROM (
    SELECT time_ns, dp_rank, num_waiting, num_running, lost
    FROM dp_loads ORDER BY time_ns DESC LIMIT {MAX_LOADS}
) ORDER BY time_ns, dp_rank
"""
_SIGNATURE_SQL = "SELECT count(*) AS spans, max(end_ns) AS last_ns FROM spans"
_STEP_REQUESTS_SQL = (
    "SELECT request_id, num_tokens FROM step_requests WHERE dp_rank = $1 AND step = $2"
)


def read_signature(source: TraceSource) -> tuple[Any, ...]:
    """Span count and last end: unchanged means nothing new arrived (a cheap refresh check)."""
    return tuple(source.query(_SIGNATURE_SQL).iloc[0])


def read_steps(source: TraceSource) -> pd.DataFrame:
    """Every rank's steps (the latest MAX_STEPS), oldest first."""
    return source.query(_STEPS_SQL)


def read_requests(source: TraceSource) -> pd.DataFrame:
    """The latest MAX_REQUESTS requests, newest first."""
    return source.query(_REQUESTS_SQL)


def read_loads(source: TraceSource) -> pd.DataFrame:
    """The load the DP coordinator published per rank (`dp_loads`), oldest first."""
    return source.query(_LOADS_SQL)


def read_timeline(source: TraceSource, t0: int, t1: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The step spans (engine core and workers) and the crossings between `t0` and `t1` (ns)."""
    return (
        source.query(_TIMELINE_SPANS_SQL, [t0, t1]),
        source.query(_TIMELINE_CROSSINGS_SQL, [t0, t1]),
    )


def read_step_requests(source: TraceSource, dp_rank: int, step: int) -> pd.DataFrame:
    """The requests step `step` of rank `dp_rank` served, with their tokens in it."""
    return source.query(_STEP_REQUESTS_SQL, [dp_rank, step])


# ---- ranks and lanes ----------------------------------------------------
def rank_color(dp_rank: int) -> str:
    return RANK_COLORS[int(dp_rank) % len(RANK_COLORS)]


def ranks_in(*frames: pd.DataFrame) -> list[int]:
    """The DP ranks in these frames' `dp_rank` columns, in order."""
    ranks: set[int] = set()
    for frame in frames:
        if "dp_rank" in frame:
            ranks.update(int(r) for r in frame["dp_rank"].dropna().unique())
    return sorted(ranks)


def lane(service: Any, rank: Any, dp_rank: Any = None) -> str:
    """A process's lane; with several DP ranks (`dp_rank` given) the rank's engine core and
    workers are named, and grouped, by rank. The API server is one process for all ranks."""
    if service == n.SERVICE_API:
        return "API server"
    prefix = "" if dp_rank is None else f"DP {int_text(dp_rank)} · "
    if service == n.SERVICE_ENGINE_CORE:
        return prefix + "engine core"
    if service == n.SERVICE_WORKER:
        return f"{prefix}worker {int_text(rank)}"
    return prefix + str(service)


_RANK_LANE = re.compile(r"DP (\d+) · (.*)")


def lane_order(lane: str) -> tuple[int, int, str]:
    """API server first, then each DP rank's engine core and its workers."""
    order = {"API server": 0, "engine core": 1}
    match = _RANK_LANE.fullmatch(lane)
    dp_rank, role = (int(match[1]), match[2]) if match else (-1 if lane in order else 0, lane)
    return (dp_rank, order.get(role, 2), role)


# ---- per-rank lines and table -------------------------------------------
def rank_series(steps: pd.DataFrame, origin_ns: int) -> dict[str, list[Any]]:
    """One line per DP rank, over time: per step of the rank, its start (ms since `origin_ns`),
    the share of the token budget it scheduled (%), the KV blocks used after scheduling, and its
    running and waiting requests. Columns of the per-rank figures' (multi-line) source."""
    data: dict[str, list[Any]] = {
        k: []
        for k in (
            "dp_rank",
            "label",
            "color",
            "xs",
            "step",
            "budget",
            "kv_used",
            "running",
            "waiting",
        )
    }
    for dp_rank in ranks_in(steps):
        mine = steps[steps["dp_rank"] == dp_rank].sort_values("start_ns")
        cols = float_columns(mine, _STEP_NUMBERS)
        tokens = np.nan_to_num(cols["num_decode_tokens"]) + np.nan_to_num(
            cols["num_prefill_tokens"]
        )
        budget = np.where(cols["token_budget"] > 0, cols["token_budget"], np.nan)
        kv_used = np.maximum(
            np.nan_to_num(cols["kv_total_blocks"]) - np.nan_to_num(cols["kv_free_after"]), 0
        )
        data["dp_rank"].append(dp_rank)
        data["label"].append(f"DP rank {dp_rank}")
        data["color"].append(rank_color(dp_rank))
        data["xs"].append((mine["start_ns"].to_numpy(float) - origin_ns) / 1e6)
        data["step"].append(cols["step"])
        data["budget"].append(tokens / budget * 100)
        data["kv_used"].append(kv_used)
        data["running"].append(cols["num_running"])
        data["waiting"].append(cols["num_waiting"])
    return data


def load_series(loads: pd.DataFrame, origin_ns: int) -> tuple[dict, dict]:
    """From `dp_loads`: one line per DP rank of the running and waiting counts the coordinator
    published from `origin_ns` on (ms since it), and one point per rank where it was first
    published lost. Columns of the load figure's line and point sources."""
    lines: dict[str, list[Any]] = {
        k: [] for k in ("dp_rank", "label", "color", "xs", "running", "waiting")
    }
    lost: dict[str, list[Any]] = {k: [] for k in ("x", "y", "label", "color")}
    # Idle heartbeats before the first request or step are left out.
    loads = loads[loads["time_ns"] >= origin_ns] if not loads.empty else loads
    for dp_rank in ranks_in(loads):
        mine = loads[loads["dp_rank"] == dp_rank].sort_values("time_ns")
        xs = (mine["time_ns"].to_numpy(float) - origin_ns) / 1e6
        cols = float_columns(mine, ["num_running", "num_waiting"])
        lines["dp_rank"].append(dp_rank)
        lines["label"].append(f"DP rank {dp_rank}")
        lines["color"].append(rank_color(dp_rank))
        lines["xs"].append(xs)
        lines["running"].append(cols["num_running"])
        lines["waiting"].append(cols["num_waiting"])
        flags = mine["lost"].fillna(False).to_numpy(bool)
        if flags.any():
            first = int(np.argmax(flags))
            lost["x"].append(xs[first])
            lost["y"].append(0.0)
            lost["label"].append(f"DP rank {dp_rank} lost")
            lost["color"].append(rank_color(dp_rank))
    return lines, lost


def rank_table(
    steps: pd.DataFrame, requests: pd.DataFrame, loads: pd.DataFrame | None = None
) -> pd.DataFrame:
    """One row per DP rank: the requests routed to it (with their output tokens and median
    TTFT), the steps it ran (mean budget use, largest queues, preemptions), and from the DP
    coordinator's `dp_loads` the mean load it published for the rank and whether it was lost."""
    if loads is None:
        loads = pd.DataFrame(columns=["dp_rank", "num_waiting", "num_running", "lost"])
    rows = []
    for dp_rank in ranks_in(steps, requests, loads):
        mine = steps[steps["dp_rank"] == dp_rank] if not steps.empty else steps
        routed = requests[requests["dp_rank"] == dp_rank] if not requests.empty else requests
        published = loads[loads["dp_rank"] == dp_rank] if not loads.empty else loads
        p = float_columns(published, ["num_waiting", "num_running"])
        s = float_columns(
            mine,
            [
                "num_decode_tokens",
                "num_prefill_tokens",
                "token_budget",
                "num_running",
                "num_waiting",
                "num_preempted",
                "duration_s",
            ],
        )
        r = float_columns(routed, ["output_tokens", "ttft_s"])
        budget = np.where(s["token_budget"] > 0, s["token_budget"], np.nan)
        used = (s["num_decode_tokens"] + s["num_prefill_tokens"]) / budget
        rows.append(
            {
                "dp_rank": dp_rank,
                "requests": len(routed),
                "output_tokens": int(np.nansum(r["output_tokens"])),
                "steps": len(mine),
                "budget_used": _nan_stat(np.nanmean, used),
                "max_running": _nan_stat(np.nanmax, s["num_running"]),
                "max_waiting": _nan_stat(np.nanmax, s["num_waiting"]),
                "preemptions": int(np.nansum(s["num_preempted"])),
                "step_ms": _nan_stat(np.nanmean, s["duration_s"]) * 1e3,
                "ttft_p50_ms": _nan_stat(np.nanmedian, r["ttft_s"]) * 1e3,
                "published_waiting": _nan_stat(np.nanmean, p["num_waiting"]),
                "published_running": _nan_stat(np.nanmean, p["num_running"]),
                "lost": bool(published["lost"].fillna(False).astype(bool).any()),
            }
        )
    return pd.DataFrame(rows)


def _nan_stat(stat: Callable[[np.ndarray], Any], values: np.ndarray) -> float:
    return float(stat(values)) if np.isfinite(values).any() else float("nan")


# ---- steps --------------------------------------------------------------
def step_series(steps: pd.DataFrame) -> tuple[dict[str, Any], dict[str, Any], float]:
    """One rank's steps (not empty) as the per-step charts' columns (`STEP_COLUMNS`), the
    preemption marks (step, y, count) drawn at `top`, and `top`: a little above the highest bar
    and the budget."""
    cols = float_columns(steps, _STEP_NUMBERS)
    total = np.nan_to_num(cols["kv_total_blocks"])
    free = np.nan_to_num(cols["kv_free_after"])
    data = dict(
        step=cols["step"],
        decode=np.nan_to_num(cols["num_decode_tokens"]),
        prefill=np.nan_to_num(cols["num_prefill_tokens"]),
        budget=cols["token_budget"],
        used=np.maximum(total - free, 0),
        free=free,
        total=total,
        running=cols["num_running"],
        waiting=cols["num_waiting"],
        preempted=cols["num_preempted"],
        hits=cols["prefix_hit_tokens"],
        duration_ms=cols["duration_s"] * 1e3,
    )
    budget = np.nanmax(cols["token_budget"]) if np.isfinite(cols["token_budget"]).any() else 0
    tokens = cols["num_decode_tokens"] + cols["num_prefill_tokens"]
    top = max(budget, np.nanmax(tokens) if len(tokens) else 0, 1) * 1.08
    mask = np.nan_to_num(cols["num_preempted"]) > 0
    marks = dict(
        step=cols["step"][mask],
        y=np.full(mask.sum(), top),
        count=cols["num_preempted"][mask].astype(int),
    )
    return data, marks, top


def kv_group_labels(windows: Sequence[Any] | None, num_groups: int) -> list[str]:
    """Names of the KV cache groups, from each one's sliding window (`kv_group_windows`, 0 for
    a group that keeps every block): "full attention" and "sliding window 512 (group 1)"; a
    trace without the windows names them "group k"."""
    if windows is None or len(windows) != num_groups:
        return [f"group {k}" for k in range(num_groups)]
    num_full = sum(1 for w in windows if not w)
    return [
        f"sliding window {int(w)} (group {k})"
        if w
        else ("full attention" if num_full == 1 else f"full attention (group {k})")
        for k, w in enumerate(windows)
    ]


def _array(value: Any) -> list[Any] | None:
    """A list column's cell (a list or an array) as a list; NULL (None or NaN) as None."""
    return None if value is None or isinstance(value, float) else list(value)


def kv_group_series(steps: pd.DataFrame) -> dict[str, list[Any]]:
    """The blocks each KV cache group holds after each step: one line per group (the columns
    of a multi-line source: xs, ys, label, color). Empty when no step has more than one group
    (a model whose layers all attend alike: the KV chart already shows its one table)."""
    data: dict[str, list[Any]] = {"xs": [], "ys": [], "label": [], "color": []}
    if steps.empty or "kv_blocks_by_group" not in steps:
        return data
    by_group = [_array(v) for v in steps["kv_blocks_by_group"]]
    num_groups = max((len(v) for v in by_group if v is not None), default=0)
    if num_groups < 2:
        return data
    windows = None
    if "kv_group_windows" in steps:
        windows = next((w for w in map(_array, steps["kv_group_windows"]) if w), None)
    xs = pd.to_numeric(steps["step"], errors="coerce").astype(float).to_numpy()
    for k, label in enumerate(kv_group_labels(windows, num_groups)):
        ys = [float(v[k]) if v is not None and k < len(v) else np.nan for v in by_group]
        data["xs"].append(xs)
        data["ys"].append(np.array(ys))
        data["label"].append(label)
        data["color"].append(RANK_COLORS[k % len(RANK_COLORS)])
    return data


def step_cards(steps: pd.DataFrame, num_ranks: int) -> list[tuple[str, str, str]]:
    """Readout cards (key, label, value) of every rank's steps together."""
    if steps.empty:
        return []
    cols = float_columns(
        steps,
        [
            "num_decode_tokens",
            "num_prefill_tokens",
            "token_budget",
            "num_preempted",
            "prefix_hit_tokens",
            "duration_s",
        ],
    )
    tokens = cols["num_decode_tokens"] + cols["num_prefill_tokens"]
    used_share = np.nanmean(
        tokens / np.where(cols["token_budget"] > 0, cols["token_budget"], np.nan)
    )
    ranks = [("eng-ranks", "DP ranks", str(num_ranks))] if num_ranks > 1 else []
    return [
        *ranks,
        ("eng-steps", "steps", str(len(steps))),
        (
            "eng-budget",
            "budget used (mean)",
            "-" if np.isnan(used_share) else f"{used_share * 100:.0f} %",
        ),
        ("eng-preempt", "preemptions", str(int(np.nansum(cols["num_preempted"])))),
        ("eng-hits", "prefix-hit tokens", str(int(np.nansum(cols["prefix_hit_tokens"])))),
        ("eng-step-ms", "step time (p50)", fmt_ms(float(np.nanmedian(cols["duration_s"])), 2)),
    ]


# ---- requests -----------------------------------------------------------
def _request_columns(requests: pd.DataFrame) -> dict[str, np.ndarray]:
    """The requests' numbers as floats, with their mean inter-token latency (`itl_s`)."""
    cols = float_columns(
        requests,
        [
            "input_tokens",
            "output_tokens",
            "cached_tokens",
            "num_preemptions",
            "queue_time_s",
            "ttft_s",
            "e2e_s",
        ],
    )
    cols["itl_s"] = np.where(
        cols["output_tokens"] > 1,
        (cols["e2e_s"] - cols["ttft_s"]) / (cols["output_tokens"] - 1),
        np.nan,
    )
    return cols


def latency_histograms(requests: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """TTFT, inter-token and end-to-end latency (ms) as histogram bars (left, right, count)."""
    hists: dict[str, dict[str, Any]] = {k: dict(left=[], right=[], count=[]) for k in LATENCIES}
    if requests.empty:
        return hists
    cols = _request_columns(requests)
    for key in LATENCIES:
        values = cols[f"{key}_s"]
        values = values[np.isfinite(values)] * 1e3
        if len(values):
            counts, edges = np.histogram(values, bins=min(24, max(len(values) // 2, 5)))
            hists[key] = dict(left=edges[:-1], right=edges[1:], count=counts)
    return hists


def request_table(requests: pd.DataFrame, several_ranks: bool) -> pd.DataFrame:
    """The request table's rows: tokens, latencies (ms), preemptions, finish reason; the rank
    that served each request where there are several."""
    if requests.empty:
        return pd.DataFrame(columns=["request_id"])
    cols = _request_columns(requests)
    table = pd.DataFrame(
        {
            "request_id": requests["request_id"].astype(str),
            "prompt": cols["input_tokens"],
            "output": cols["output_tokens"],
            "cached": cols["cached_tokens"],
            "queue_ms": cols["queue_time_s"] * 1e3,
            "ttft_ms": cols["ttft_s"] * 1e3,
            "itl_ms": cols["itl_s"] * 1e3,
            "e2e_ms": cols["e2e_s"] * 1e3,
            "preemptions": cols["num_preemptions"],
            "finish": requests["finish_reason"].fillna("-").astype(str),
        }
    )
    for column in ("prompt", "output", "cached", "preemptions"):
        table[column] = table[column].fillna(0).astype(int)
    if several_ranks:
        table.insert(1, "dp_rank", requests["dp_rank"].fillna(0).astype(int).to_numpy())
    return table


def request_cards(requests: pd.DataFrame) -> list[tuple[str, str, str]]:
    """Readout cards (key, label, value) of the requests: count and median latencies."""
    if requests.empty:
        return []
    cols = _request_columns(requests)
    itl = cols["itl_s"]
    return [
        ("eng-requests", "requests", str(len(requests))),
        ("eng-ttft", "TTFT (p50)", fmt_ms(float(np.nanmedian(cols["ttft_s"])), 2)),
        (
            "eng-itl",
            "inter-token (p50)",
            fmt_ms(float(np.nanmedian(itl)), 2) if np.isfinite(itl).any() else "-",
        ),
        ("eng-e2e", "end to end (p50)", fmt_ms(float(np.nanmedian(cols["e2e_s"])), 2)),
    ]


# ---- the process timeline -----------------------------------------------
def timeline_window(
    steps: pd.DataFrame, step: int | None, origin_ns: int | None
) -> tuple[int, int]:
    """The span of time (ns) of TIMELINE_STEPS of `steps` (not empty): the latest, or those
    around `step`, with 2 ms either side."""
    if step is None:
        window = steps.tail(TIMELINE_STEPS)
    else:
        position = int(np.searchsorted(steps["step"].to_numpy(), step))
        lo = max(position - TIMELINE_STEPS // 2, 0)
        window = steps.iloc[lo : lo + TIMELINE_STEPS]
    t0 = int(window["start_ns"].min()) - 2_000_000
    if origin_ns is not None and window.index[0] == steps.index[0]:
        # The run's first steps: from its start, so the requests' arrivals (api->engine_core
        # crossings, sent before the engine core's first step) are on the timeline too.
        t0 = min(t0, origin_ns)
    t1 = int(window["end_ns"].max()) + 2_000_000
    return t0, t1


def _by_rank(values: pd.Series, several_ranks: bool) -> list[Any]:
    """Each row's DP rank where lanes are grouped by rank, else None."""
    return list(values) if several_ranks else [None] * len(values)


def timeline_bars(spans: pd.DataFrame, origin_ns: int, several_ranks: bool) -> dict[str, Any]:
    """One bar per step span: its lane, start and end (ms since `origin_ns`), its `kind`
    ("engine core" or "worker"), a label and the step."""
    # Lanes by role, not process: an offline run does every role in one process.
    kinds = ["engine core" if name == n.ENGINE_STEP else "worker" for name in spans["name"]]
    roles = [n.SERVICE_ENGINE_CORE if k == "engine core" else n.SERVICE_WORKER for k in kinds]
    dp_ranks = _by_rank(spans["dp_rank"], several_ranks)
    lanes = [
        lane(role, rank, dp_rank)
        for role, rank, dp_rank in zip(roles, spans["rank"], dp_ranks, strict=True)
    ]
    return dict(
        lane=lanes,
        left=((spans["start_ns"] - origin_ns) / 1e6).to_numpy(float),
        right=((spans["end_ns"] - origin_ns) / 1e6).to_numpy(float),
        kind=kinds,
        label=[
            f"{lane}: step {int_text(s)}, {(e - b) / 1e6:.2f} ms"
            for lane, s, b, e in zip(
                lanes, spans["step"], spans["start_ns"], spans["end_ns"], strict=True
            )
        ],
        step=[int_text(s) for s in spans["step"]],
    )


def timeline_links(links: pd.DataFrame, origin_ns: int, several_ranks: bool) -> dict[str, Any]:
    """One segment per crossing, from its sender's lane at the send to its receiver's at the
    receipt (ms since `origin_ns`), with its boundary and a label."""
    ends = {}
    for end in ("src", "dst"):
        services, ranks = links[f"{end}_service"], links[f"{end}_rank"]
        dp_ranks = _by_rank(links[f"{end}_dp_rank"], several_ranks)
        ends[end] = [lane(s, r, d) for s, r, d in zip(services, ranks, dp_ranks, strict=True)]
    return dict(
        x0=((links["send_ns"] - origin_ns) / 1e6).to_numpy(float),
        y0=ends["src"],
        x1=((links["recv_ns"] - origin_ns) / 1e6).to_numpy(float),
        y1=ends["dst"],
        boundary=list(links["boundary"]),
        label=[
            f"{b}: {m}, {int_text(nb)} B, {int_text(k)} req"
            for b, m, nb, k in zip(
                links["boundary"],
                links["message_type"],
                links["bytes"],
                links["num_requests"],
                strict=True,
            )
        ],
    )


def timeline_lanes(
    bars: dict[str, Any], links: dict[str, Any], ranks: list[int], several_ranks: bool
) -> list[str]:
    """The timeline's lanes, bottom to top (each rank's engine core even when it is idle)."""
    cores = {lane(n.SERVICE_ENGINE_CORE, None, r if several_ranks else None) for r in ranks}
    found = set(bars["lane"]) | set(links["y0"]) | set(links["y1"]) | cores
    return list(reversed(sorted(found, key=lane_order)))
