"""Dashboard page 3: the engine step by step, from the `steps`, `requests`, `crossings` views.

Per-step token budget (decode vs prefill), KV blocks used and free, running and waiting counts,
preemptions, a timeline of steps per process with the messages between them, latency
histograms, and a request table whose rows open the request path page. A finished file is
replayed with a step player; a live source is re-read by the app every second.

With data parallelism (several `dp_rank`s) the page adds a table of each rank's work and, over
time, one line per rank of its token budget use, KV blocks and queue, and of the load the DP
coordinator published (`dp_loads`: what the API servers routed by, with the moment a rank was
lost); the per-step charts and the player show one rank at a time (step indexes count per rank),
picked with a selector; and the timeline groups the processes by rank.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import panel as pn
from bokeh.models import (
    BoxAnnotation,
    ColumnDataSource,
    FactorRange,
    HoverTool,
    NumberFormatter,
    Range1d,
    Span,
)
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from stepscope.traces import names as n
from stepscope.viz.sources import TraceSource
from stepscope.viz.ui import (
    COLORS,
    CSS,
    NO_TRACE,
    TABLE_CSS,
    bokeh_pane,
    cards,
    float_columns,
    fmt_ms,
    int_text,
    new_figure,
    outside_legend,
)

TIMELINE_STEPS = 40  # steps shown in the process timeline at once
MAX_STEPS = 5000  # steps read per refresh (the most recent)
MAX_REQUESTS = 5000

# ---- queries -----------------------------------------------------------
_STEPS_SQL = f"""
SELECT * FROM (
    SELECT step, start_ns, end_ns, duration_s, num_running, num_waiting, num_decode_tokens,
           num_prefill_tokens, token_budget, kv_free_before, kv_free_after, kv_total_blocks,
           prefix_hit_tokens, num_preempted, num_finished, dp_rank
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
MAX_LOADS = 20_000  # DP coordinator rows read per refresh (the most recent)
_LOADS_SQL = f"""
SELECT * FROM (
    SELECT time_ns, dp_rank, num_waiting, num_running, lost
    FROM dp_loads ORDER BY time_ns DESC LIMIT {MAX_LOADS}
) ORDER BY time_ns, dp_rank
"""
_SIGNATURE_SQL = "SELECT count(*) AS spans, max(end_ns) AS last_ns FROM spans"
# Step indexes count per data-parallel rank: a step is (dp_rank, step).
_STEP_REQUESTS_SQL = (
    "SELECT request_id, num_tokens FROM step_requests WHERE dp_rank = $1 AND step = $2"
)
RANK_COLORS = Category10_10


def _lane(service: Any, rank: Any, dp_rank: Any = None) -> str:
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


def _lane_order(lane: str) -> tuple[int, int, str]:
    """API server first, then each DP rank's engine core and its workers."""
    order = {"API server": 0, "engine core": 1}
    match = _RANK_LANE.fullmatch(lane)
    dp_rank, role = (int(match[1]), match[2]) if match else (-1 if lane in order else 0, lane)
    return (dp_rank, order.get(role, 2), role)


def rank_color(dp_rank: int) -> str:
    return RANK_COLORS[int(dp_rank) % len(RANK_COLORS)]


def _ranks(*frames: pd.DataFrame) -> list[int]:
    """The DP ranks in these frames' `dp_rank` columns, in order."""
    ranks: set[int] = set()
    for frame in frames:
        if "dp_rank" in frame:
            ranks.update(int(r) for r in frame["dp_rank"].dropna().unique())
    return sorted(ranks)


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
    for dp_rank in _ranks(steps):
        mine = steps[steps["dp_rank"] == dp_rank].sort_values("start_ns")
        cols = float_columns(
            mine,
            [
                "step",
                "start_ns",
                "num_decode_tokens",
                "num_prefill_tokens",
                "token_budget",
                "kv_free_after",
                "kv_total_blocks",
                "num_running",
                "num_waiting",
            ],
        )
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
    for dp_rank in _ranks(loads):
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
    for dp_rank in _ranks(steps, requests, loads):
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


def _rank_table_html(table: pd.DataFrame) -> str:
    def num(value: Any, fmt: str = "{:.0f}") -> str:
        return "-" if value is None or pd.isna(value) else fmt.format(value)

    rows = []
    for r in table.itertuples(index=False):
        rows.append(
            f'<tr id="rank-{r.dp_rank}"><td><span class="ss-dot" '
            f'style="background:{rank_color(r.dp_rank)}"></span><b>DP rank {r.dp_rank}</b></td>'
            f'<td class="num">{r.requests}</td><td class="num">{r.output_tokens}</td>'
            f'<td class="num">{r.steps}</td>'
            f'<td class="num">{num(r.budget_used * 100, "{:.0f} %")}</td>'
            f'<td class="num">{num(r.max_running)}</td><td class="num">{num(r.max_waiting)}</td>'
            f'<td class="num">{r.preemptions}</td>'
            f'<td class="num">{num(r.step_ms, "{:.2f}")}</td>'
            f'<td class="num">{num(r.ttft_p50_ms, "{:.2f}")}</td>'
            f'<td class="num">{num(r.published_waiting, "{:.1f}")} / '
            f"{num(r.published_running, '{:.1f}')}</td>"
            f"<td>{'lost' if r.lost else 'up'}</td></tr>"
        )
    head = (
        "<tr><th>rank</th><th>requests</th><th>output tokens</th><th>steps</th>"
        "<th>budget used (mean)</th><th>running (max)</th><th>waiting (max)</th>"
        "<th>preemptions</th><th>step (mean ms)</th><th>TTFT (p50 ms)</th>"
        "<th>coordinator: waiting / running (mean)</th><th>coordinator: status</th></tr>"
    )
    return f'<table class="ss-table" id="rank-table">{head}{"".join(rows)}</table>'


def _step_markers(count: int = 3) -> list[Span]:
    """One dashed line per chart, hidden until the player marks a step on it."""
    return [
        Span(
            location=0,
            dimension="height",
            line_color="#33414e",
            line_width=1.5,
            line_dash="dashed",
            visible=False,
        )
        for _ in range(count)
    ]


class EnginePage:
    """Per-step budget, KV usage, queues and preemptions; a process timeline; latencies."""

    def __init__(self, source: TraceSource | None, open_request: Callable[[str], None]) -> None:
        self.source = source
        self.open_request = open_request
        self.signature: tuple[Any, ...] | None = None
        self.origin_ns: int | None = None
        self.all_steps = pd.DataFrame()  # every rank's steps
        self.steps = pd.DataFrame()  # the shown rank's steps (every step with one rank)
        self.ranks: list[int] = [0]
        self.dp_rank = 0  # the rank the per-step charts and the player show
        self.summary = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.empty = pn.pane.Markdown(NO_TRACE, visible=source is None)

        self.step_source = ColumnDataSource(
            {
                k: []
                for k in (
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
            }
        )
        self.preempt_source = ColumnDataSource(dict(step=[], y=[], count=[]))
        self.markers = _step_markers()
        self.tokens_fig = self._tokens_figure()
        self.kv_fig = self._kv_figure()
        self.queue_fig = self._queue_figure()
        for fig, marker in zip(
            (self.tokens_fig, self.kv_fig, self.queue_fig), self.markers, strict=True
        ):
            fig.add_layout(marker)
        self.kv_fig.x_range = self.tokens_fig.x_range
        self.queue_fig.x_range = self.tokens_fig.x_range

        self.lane_bars = ColumnDataSource(
            dict(lane=[], left=[], right=[], color=[], label=[], step=[])
        )
        self.lane_links = ColumnDataSource(
            dict(x0=[], y0=[], x1=[], y1=[], boundary=[], color=[], label=[])
        )
        self.timeline_fig = self._timeline_figure()

        # With several DP ranks: each rank's work, and one line per rank over time.
        self.rank_lines = ColumnDataSource(
            dict(
                dp_rank=[],
                label=[],
                color=[],
                xs=[],
                step=[],
                budget=[],
                kv_used=[],
                running=[],
                waiting=[],
            )
        )
        self.load_lines = ColumnDataSource(
            dict(dp_rank=[], label=[], color=[], xs=[], running=[], waiting=[])
        )
        self.lost_points = ColumnDataSource(dict(x=[], y=[], label=[], color=[]))
        self.rank_markers = _step_markers(4)
        self.rank_figs = [
            self._rank_figure("Token budget used per step, per DP rank (%)", "budget", "% used"),
            self._rank_figure("KV blocks used after scheduling, per DP rank", "kv_used", "blocks"),
            self._rank_figure(
                "Running (solid) and waiting (dashed) requests, per DP rank",
                "running",
                "requests",
                dashed="waiting",
            ),
            self._load_figure(),
        ]
        for fig, marker in zip(self.rank_figs, self.rank_markers, strict=True):
            fig.add_layout(marker)
            fig.x_range = self.rank_figs[0].x_range
        self.rank_summary = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.rank_box = pn.Column(
            pn.pane.Markdown(
                "#### Data-parallel ranks\n"
                "Each rank is an engine core with its own scheduler, KV cache and workers; the "
                "API server sends each request to the least-loaded rank, by the load the DP "
                "coordinator last published (the fourth chart: `dp_loads`). Step indexes count "
                "per rank: the per-step charts below show the rank picked beside the player."
            ),
            self.rank_summary,
            *[
                pn.Row(*[bokeh_pane(f) for f in pair], sizing_mode="stretch_width")
                for pair in (self.rank_figs[:2], self.rank_figs[2:])
            ],
            sizing_mode="stretch_width",
            visible=False,
        )
        self.rank_select = pn.widgets.Select(label="DP rank", options={}, width=140, visible=False)
        self.rank_select.param.watch(lambda e: self._select_rank(e.new), "value")

        self.hists = {
            key: ColumnDataSource(dict(left=[], right=[], count=[]))
            for key in ("ttft", "itl", "e2e")
        }
        self.hist_figs = [
            self._histogram(key, title, color)
            for key, title, color in (
                ("ttft", "Time to first token (ms)", COLORS["prefill"]),
                ("itl", "Inter-token latency (ms): (e2e − TTFT) / (output − 1)", COLORS["decode"]),
                ("e2e", "End-to-end latency (ms)", COLORS["free"]),
            )
        ]
        self.table = pn.widgets.Tabulator(
            pd.DataFrame(),
            disabled=True,
            show_index=False,
            selectable=1,
            pagination="local",
            page_size=15,
            sizing_mode="stretch_width",
            layout="fit_data_stretch",
            theme="simple",
            stylesheets=[TABLE_CSS],
            css_classes=["request-table"],
            titles={
                "request_id": "request",
                "dp_rank": "DP rank",
                "queue_ms": "queue (ms)",
                "ttft_ms": "TTFT (ms)",
                "itl_ms": "inter-token (ms)",
                "e2e_ms": "end to end (ms)",
            },
            formatters={
                c: NumberFormatter(format="0.00")
                for c in ("queue_ms", "ttft_ms", "itl_ms", "e2e_ms")
            },
        )
        self.table.param.watch(self._selected, "selection")

        self.player = pn.widgets.Player(
            label="Replay: step",
            start=0,
            end=1,
            value=0,
            interval=250,
            loop_policy="once",
            show_loop_controls=False,
            width=520,
            visible=False,
        )
        self.player.param.watch(lambda e: self.show_step(e.new), "value")
        self.step_detail = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.content = pn.Column(
            self.summary,
            self.rank_box,
            pn.Row(self.rank_select, self.player, self.step_detail, sizing_mode="stretch_width"),
            pn.Row(
                bokeh_pane(self.tokens_fig), bokeh_pane(self.kv_fig), sizing_mode="stretch_width"
            ),
            pn.Row(
                bokeh_pane(self.queue_fig),
                bokeh_pane(self.timeline_fig),
                sizing_mode="stretch_width",
            ),
            pn.Row(*[bokeh_pane(f) for f in self.hist_figs], sizing_mode="stretch_width"),
            pn.pane.Markdown("#### Requests (click a row to open its path)"),
            self.table,
            sizing_mode="stretch_width",
            visible=source is not None,
        )
        self.panel = pn.Column(self.empty, self.content, sizing_mode="stretch_width")
        self.refresh()

    # -- figures --
    def _tokens_figure(self) -> figure:
        fig = new_figure(
            "Tokens per step: decode vs prefill, and the token budget",
            y_range=Range1d(0, 1),
            x_axis_label="step",
            y_axis_label="tokens",
        )
        bars = fig.vbar_stack(
            ["decode", "prefill"],
            x="step",
            width=0.85,
            source=self.step_source,
            color=[COLORS["decode"], COLORS["prefill"]],
            legend_label=["decode", "prefill"],
        )
        fig.step(
            "step",
            "budget",
            source=self.step_source,
            mode="center",
            line_dash="dashed",
            color="#33414e",
            line_width=1.5,
            legend_label="budget",
        )
        marks = fig.scatter(
            "step",
            "y",
            source=self.preempt_source,
            marker="inverted_triangle",
            size=12,
            color=COLORS["preempt"],
            legend_label="preemption",
        )
        fig.add_tools(
            HoverTool(
                renderers=bars,
                tooltips=[
                    ("step", "@step"),
                    ("decode", "@decode"),
                    ("prefill", "@prefill"),
                    ("budget", "@budget"),
                    ("duration", "@duration_ms{0.00} ms"),
                    ("prefix-hit tokens", "@hits"),
                ],
            )
        )
        fig.add_tools(HoverTool(renderers=[marks], tooltips=[("preempted", "@count at @step")]))
        outside_legend(fig)
        return fig

    def _kv_figure(self) -> figure:
        fig = new_figure(
            "KV blocks after scheduling: used vs free", x_axis_label="step", y_axis_label="blocks"
        )
        areas = fig.varea_stack(
            ["used", "free"],
            x="step",
            source=self.step_source,
            color=[COLORS["used"], COLORS["free"]],
            legend_label=["used", "free"],
            alpha=0.85,
        )
        fig.line("step", "used", source=self.step_source, color="#2b6a99", line_width=1)
        fig.add_tools(
            HoverTool(
                renderers=areas[:1],
                tooltips=[("step", "@step"), ("used", "@used"), ("free", "@free")],
                mode="vline",
            )
        )
        fig.y_range.start = 0
        outside_legend(fig)
        return fig

    def _queue_figure(self) -> figure:
        fig = new_figure(
            "Running and waiting requests", x_axis_label="step", y_axis_label="requests"
        )
        for key in ("running", "waiting"):
            fig.step(
                "step",
                key,
                source=self.step_source,
                mode="center",
                color=COLORS[key],
                line_width=2,
                legend_label=key,
            )
        fig.add_tools(
            HoverTool(
                tooltips=[("step", "@step"), ("running", "@running"), ("waiting", "@waiting")],
                mode="vline",
            )
        )
        fig.y_range.start = 0
        outside_legend(fig)
        return fig

    def _timeline_figure(self) -> figure:
        fig = new_figure(
            "Timeline: steps per process, messages between them (ms)",
            x_range=Range1d(0, 1),
            y_range=FactorRange("worker 0", "engine core", "API server"),
            x_axis_label="ms since the first span",
        )
        # The replayed step, shaded.
        self.timeline_step = BoxAnnotation(
            left=0, right=0, fill_color="#33414e", fill_alpha=0.12, visible=False
        )
        fig.add_layout(self.timeline_step)
        bars = fig.hbar(
            y="lane",
            left="left",
            right="right",
            height=0.5,
            color="color",
            source=self.lane_bars,
            alpha=0.85,
        )
        links = fig.segment(
            x0="x0",
            y0="y0",
            x1="x1",
            y1="y1",
            color="color",
            line_width=1.2,
            alpha=0.7,
            source=self.lane_links,
        )
        fig.add_tools(HoverTool(renderers=[bars], tooltips=[("", "@label")]))
        fig.add_tools(HoverTool(renderers=[links], tooltips=[("", "@label")], line_policy="interp"))
        return fig

    def _load_figure(self) -> figure:
        """The DP coordinator's publications: per rank, running (solid) and waiting (dashed) as
        the API servers saw them when routing; an x where a rank was first published lost."""
        fig = self._rank_figure(
            "Load the DP coordinator published, per rank: running (solid), waiting (dashed)",
            "running",
            "requests",
            dashed="waiting",
            source=self.load_lines,
        )
        lost = fig.scatter(
            x="x",
            y="y",
            source=self.lost_points,
            marker="x",
            size=14,
            line_width=3,
            color="color",
        )
        fig.add_tools(HoverTool(renderers=[lost], tooltips=[("", "@label"), ("ms", "@x{0.0}")]))
        return fig

    def _rank_figure(
        self,
        title: str,
        column: str,
        y_label: str,
        dashed: str | None = None,
        source: ColumnDataSource | None = None,
    ) -> figure:
        """One line per DP rank of `column` over time (and of `dashed`, dashed), from
        `source` (default: the per-step lines)."""
        source = self.rank_lines if source is None else source
        fig = new_figure(title, x_axis_label="ms since the first span", y_axis_label=y_label)
        lines = [
            fig.multi_line(
                xs="xs",
                ys=column,
                source=source,
                line_color="color",
                line_width=2,
                legend_field="label",
            )
        ]
        if dashed is not None:
            lines.append(
                fig.multi_line(
                    xs="xs",
                    ys=dashed,
                    source=source,
                    line_color="color",
                    line_width=2,
                    line_dash="dashed",
                )
            )
        fig.add_tools(
            HoverTool(
                renderers=lines,
                tooltips=[("", "@label"), ("ms", "$x{0.0}"), (y_label, "$y{0.0}")],
                line_policy="interp",
            )
        )
        fig.y_range.start = 0
        outside_legend(fig)
        return fig

    def _histogram(self, key: str, title: str, color: str) -> figure:
        fig = new_figure(title, height=220, y_axis_label="requests")
        fig.quad(
            top="count",
            bottom=0,
            left="left",
            right="right",
            source=self.hists[key],
            color=color,
            alpha=0.85,
            line_color="white",
        )
        fig.add_tools(
            HoverTool(tooltips=[("ms", "@left{0.00} – @right{0.00}"), ("requests", "@count")])
        )
        fig.y_range.start = 0
        return fig

    # -- data --
    def refresh(self) -> None:
        """Re-read the trace (cheaply skipped when nothing new arrived)."""
        if self.source is None:
            return
        signature = tuple(self.source.query(_SIGNATURE_SQL).iloc[0])
        if signature == self.signature:
            return
        self.signature = signature
        steps = self.source.query(_STEPS_SQL)
        requests = self.source.query(_REQUESTS_SQL)
        if steps.empty and requests.empty:
            self.empty.object = "No steps or requests in this trace yet."
            self.empty.visible = True
            self.content.visible = False
            return
        self.empty.visible = False
        self.content.visible = True
        starts = [f["start_ns"].min() for f in (steps, requests) if not f.empty]
        self.origin_ns = int(min(starts))
        self.all_steps = steps
        self.ranks = _ranks(steps, requests) or [0]
        self._step_summary = self._step_cards(steps)
        self._show_ranks(steps, requests)
        self._show_requests(requests, steps)
        if self.dp_rank not in self.ranks:
            self.dp_rank = self.ranks[0]
        options = {f"rank {r}": r for r in self.ranks}
        if options != self.rank_select.options:
            self.rank_select.options = options
        self.rank_select.visible = len(self.ranks) > 1
        if self.rank_select.value != self.dp_rank:
            self.rank_select.value = self.dp_rank  # calls _select_rank
        else:
            self._select_rank(self.dp_rank)

    @property
    def several_ranks(self) -> bool:
        return len(self.ranks) > 1

    def _select_rank(self, dp_rank: int | None) -> None:
        """Show `dp_rank`'s steps on the per-step charts, the player and the timeline."""
        if dp_rank is None or self.source is None:
            return
        self.dp_rank = int(dp_rank)
        steps = self.all_steps
        if not steps.empty and self.several_ranks:
            steps = steps[steps["dp_rank"] == self.dp_rank].reset_index(drop=True)
        for fig, title in zip(
            (self.tokens_fig, self.kv_fig, self.queue_fig),
            (
                "Tokens per step: decode vs prefill, and the token budget",
                "KV blocks after scheduling: used vs free",
                "Running and waiting requests",
            ),
            strict=True,
        ):
            fig.title.text = f"{title} (DP rank {self.dp_rank})" if self.several_ranks else title
        self._show_steps(steps)
        if self.source.live or steps.empty:
            self.player.visible = False
            self._show_timeline(None)
        else:
            self.player.visible = True
            start = int(steps["step"].min())
            end = max(int(steps["step"].max()), start + 1)
            # Bounds in an order that never puts start above end on the way.
            if start > self.player.end:
                self.player.end, self.player.start = end, start
            else:
                self.player.start, self.player.end = start, end
            value = min(max(self.player.value, start), end)
            if value != self.player.value:
                self.player.value = value  # calls show_step
            else:
                self.show_step(value)

    def _show_ranks(self, steps: pd.DataFrame, requests: pd.DataFrame) -> None:
        """The per-rank table and lines (only with several DP ranks)."""
        self.rank_box.visible = self.several_ranks
        if not self.several_ranks:
            for source in (self.rank_lines, self.load_lines, self.lost_points):
                source.data = {k: [] for k in source.data}
            self.rank_summary.object = ""
            return
        assert self.source is not None
        loads = self.source.query(_LOADS_SQL)
        self.rank_lines.data = rank_series(steps, self.origin_ns or 0)
        self.load_lines.data, self.lost_points.data = load_series(loads, self.origin_ns or 0)
        self.rank_summary.object = _rank_table_html(rank_table(steps, requests, loads))

    def _show_steps(self, steps: pd.DataFrame) -> None:
        self.steps = steps
        if steps.empty:
            self.step_source.data = {k: [] for k in self.step_source.data}
            self.preempt_source.data = dict(step=[], y=[], count=[])
            return
        cols = float_columns(
            steps,
            [
                "step",
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
            ],
        )
        total = np.nan_to_num(cols["kv_total_blocks"])
        free = np.nan_to_num(cols["kv_free_after"])
        self.step_source.data = dict(
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
        self.preempt_source.data = dict(
            step=cols["step"][mask],
            y=np.full(mask.sum(), top),
            count=cols["num_preempted"][mask].astype(int),
        )
        self.tokens_fig.y_range.end = top * 1.12

    def _step_cards(self, steps: pd.DataFrame) -> list[tuple[str, str, str]]:
        """Readout cards of every rank's steps together."""
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
        ranks = [("eng-ranks", "DP ranks", str(len(self.ranks)))] if self.several_ranks else []
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

    def _show_requests(self, requests: pd.DataFrame, steps: pd.DataFrame) -> None:
        if requests.empty:
            frame = pd.DataFrame(columns=["request_id"])
            for source in self.hists.values():
                source.data = dict(left=[], right=[], count=[])
            self.table.value = frame
            self.summary.object = cards(getattr(self, "_step_summary", []))
            return
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
        itl = np.where(
            cols["output_tokens"] > 1,
            (cols["e2e_s"] - cols["ttft_s"]) / (cols["output_tokens"] - 1),
            np.nan,
        )
        for key, values in (("ttft", cols["ttft_s"]), ("itl", itl), ("e2e", cols["e2e_s"])):
            values = values[np.isfinite(values)] * 1e3
            if len(values):
                counts, edges = np.histogram(values, bins=min(24, max(len(values) // 2, 5)))
                self.hists[key].data = dict(left=edges[:-1], right=edges[1:], count=counts)
            else:
                self.hists[key].data = dict(left=[], right=[], count=[])
        table = pd.DataFrame(
            {
                "request_id": requests["request_id"].astype(str),
                "prompt": cols["input_tokens"],
                "output": cols["output_tokens"],
                "cached": cols["cached_tokens"],
                "queue_ms": cols["queue_time_s"] * 1e3,
                "ttft_ms": cols["ttft_s"] * 1e3,
                "itl_ms": itl * 1e3,
                "e2e_ms": cols["e2e_s"] * 1e3,
                "preemptions": cols["num_preemptions"],
                "finish": requests["finish_reason"].fillna("-").astype(str),
            }
        )
        for column in ("prompt", "output", "cached", "preemptions"):
            table[column] = table[column].fillna(0).astype(int)
        if self.several_ranks:
            table.insert(1, "dp_rank", requests["dp_rank"].fillna(0).astype(int).to_numpy())
        self.table.value = table
        self.summary.object = cards(
            [
                ("eng-requests", "requests", str(len(requests))),
                ("eng-ttft", "TTFT (p50)", fmt_ms(float(np.nanmedian(cols["ttft_s"])), 2)),
                (
                    "eng-itl",
                    "inter-token (p50)",
                    fmt_ms(float(np.nanmedian(itl)), 2) if np.isfinite(itl).any() else "-",
                ),
                ("eng-e2e", "end to end (p50)", fmt_ms(float(np.nanmedian(cols["e2e_s"])), 2)),
                *getattr(self, "_step_summary", []),
            ]
        )

    def _show_timeline(self, step: int | None) -> None:
        """Steps and crossings of TIMELINE_STEPS steps: the latest, or those around `step`."""
        steps = self.steps
        if steps.empty or self.source is None:
            return
        if step is None:
            window = steps.tail(TIMELINE_STEPS)
        else:
            position = int(np.searchsorted(steps["step"].to_numpy(), step))
            lo = max(position - TIMELINE_STEPS // 2, 0)
            window = steps.iloc[lo : lo + TIMELINE_STEPS]
        t0 = int(window["start_ns"].min()) - 2_000_000
        if self.origin_ns is not None and window.index[0] == steps.index[0]:
            # The run's first steps: from its start, so the requests' arrivals (api->engine_core
            # crossings, sent before the engine core's first step) are on the timeline too.
            t0 = min(t0, self.origin_ns)
        t1 = int(window["end_ns"].max()) + 2_000_000
        spans = self.source.query(_TIMELINE_SPANS_SQL, [t0, t1])
        links = self.source.query(_TIMELINE_CROSSINGS_SQL, [t0, t1])
        origin = self.origin_ns or t0
        several = self.several_ranks

        def dp(values: pd.Series) -> list[Any]:
            """Each row's DP rank where lanes are grouped by rank, else None."""
            return list(values) if several else [None] * len(values)

        # Lanes by role, not process: an offline run does every role in one process.
        kinds = ["engine core" if name == n.ENGINE_STEP else "worker" for name in spans["name"]]
        roles = [n.SERVICE_ENGINE_CORE if k == "engine core" else n.SERVICE_WORKER for k in kinds]
        lanes = [
            _lane(role, rank, dp_rank)
            for role, rank, dp_rank in zip(roles, spans["rank"], dp(spans["dp_rank"]), strict=True)
        ]
        self.lane_bars.data = dict(
            lane=lanes,
            left=((spans["start_ns"] - origin) / 1e6).to_numpy(float),
            right=((spans["end_ns"] - origin) / 1e6).to_numpy(float),
            color=[COLORS[k] for k in kinds],
            label=[
                f"{lane}: step {int_text(s)}, {(e - b) / 1e6:.2f} ms"
                for lane, s, b, e in zip(
                    lanes, spans["step"], spans["start_ns"], spans["end_ns"], strict=True
                )
            ],
            step=[int_text(s) for s in spans["step"]],
        )
        src = [
            _lane(s, r, d)
            for s, r, d in zip(
                links["src_service"], links["src_rank"], dp(links["src_dp_rank"]), strict=True
            )
        ]
        dst = [
            _lane(s, r, d)
            for s, r, d in zip(
                links["dst_service"], links["dst_rank"], dp(links["dst_dp_rank"]), strict=True
            )
        ]
        boundary_colors = {
            n.API_TO_ENGINE_CORE: "#4C78A8",
            n.ENGINE_CORE_TO_WORKER: "#B279A2",
            n.WORKER_TO_ENGINE_CORE: "#9D755D",
            n.ENGINE_CORE_TO_API: "#E45756",
        }
        self.lane_links.data = dict(
            x0=((links["send_ns"] - origin) / 1e6).to_numpy(float),
            y0=src,
            x1=((links["recv_ns"] - origin) / 1e6).to_numpy(float),
            y1=dst,
            boundary=list(links["boundary"]),
            color=[boundary_colors.get(b, COLORS["crossing"]) for b in links["boundary"]],
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
        cores = {_lane(n.SERVICE_ENGINE_CORE, None, r if several else None) for r in self.ranks}
        all_lanes = sorted(set(lanes) | set(src) | set(dst) | cores, key=_lane_order)
        self.timeline_fig.y_range.factors = list(reversed(all_lanes))
        self.timeline_fig.x_range.start = (t0 - origin) / 1e6
        self.timeline_fig.x_range.end = (t1 - origin) / 1e6

    def show_step(self, step: int) -> None:
        """Replay: mark `step` on the step charts, center the timeline on it, list its requests."""
        steps = self.steps
        if steps.empty or self.source is None:
            return
        for marker in self.markers:
            marker.location = step
            marker.visible = True
        self._show_timeline(step)
        row = steps[steps["step"] == step]
        # With several DP ranks, "step 3" alone is ambiguous: name the rank.
        name = f"DP rank {self.dp_rank}, step {step}" if self.several_ranks else f"step {step}"
        if row.empty:
            self.step_detail.object = f'<i id="replay-step">{name}: not traced</i>'
            for marker in self.rank_markers:
                marker.visible = False
            return
        r = row.iloc[0]
        origin = self.origin_ns or 0
        # Times from the columns: a row of mixed columns is float64, too coarse for ns.
        self.timeline_step.left = (int(row["start_ns"].iloc[0]) - origin) / 1e6
        self.timeline_step.right = (int(row["end_ns"].iloc[0]) - origin) / 1e6
        self.timeline_step.visible = True
        for marker in self.rank_markers:
            marker.location = self.timeline_step.left
            marker.visible = self.several_ranks
        served = self.source.query(_STEP_REQUESTS_SQL, [self.dp_rank, int(step)])
        who = ", ".join(
            f"{rid} ({k})"
            for rid, k in zip(served["request_id"], served["num_tokens"], strict=True)
        )
        self.step_detail.object = (
            f'<div class="ss-formula" id="replay-step"><b>{name}</b>: '
            f"{int_text(r.num_decode_tokens)} decode + {int_text(r.num_prefill_tokens)} prefill of "
            f"{int_text(r.token_budget)}; KV free {int_text(r.kv_free_before)} → "
            f"{int_text(r.kv_free_after)} of {int_text(r.kv_total_blocks)}; running "
            f"{int_text(r.num_running)}, waiting {int_text(r.num_waiting)}; preempted "
            f"{int_text(r.num_preempted)}; {fmt_ms(r.duration_s, 2)}<br>"
            f"requests (tokens): {html.escape(who) or '-'}</div>"
        )

    def _selected(self, event: Any) -> None:
        if not event.new:
            return
        rid = str(self.table.value.iloc[event.new[0]]["request_id"])
        doc = pn.state.curdoc
        if doc is not None and doc.session_context is not None:
            # Tabulator reports selections without holding the document lock, which the Bokeh
            # figures of the request page need: open it on the next tick, under the lock.
            doc.add_next_tick_callback(lambda: self.open_request(rid))
        else:
            self.open_request(rid)
