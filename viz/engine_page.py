"""Dashboard page 3: the engine step by step, from the `steps`, `requests`, `crossings` views.

Per-step token budget (decode vs prefill), KV blocks used and free, running and waiting counts,
preemptions (and, for a model with several KV cache groups, the blocks each group holds: its
sliding-window groups flat while its full-attention group grows), a timeline of steps per
process with the messages between them, latency histograms, and a request table whose rows open
the request path page. A finished file is replayed with a step player; a live source is
re-read by the app every second.

With data parallelism (several `dp_rank`s) the page adds a table of each rank's work and, over
time, one line per rank of its token budget use, KV blocks and queue, and of the load the DP
coordinator published (`dp_loads`: what the API servers routed by, with the moment a rank was
lost); the per-step charts and the player show one rank at a time (step indexes count per rank),
picked with a selector; and the timeline groups the processes by rank.

This module holds the figures and the layout; the SQL and the shaping of its answers are in
`engine_data` (no Panel), the data-parallel section in `rank_panel`.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import pandas as pd
import panel as pn
from bokeh.models import (
    BoxAnnotation,
    ColumnDataSource,
    FactorRange,
    HoverTool,
    NumberFormatter,
    Range1d,
)
from bokeh.plotting import figure

from stepscope.traces import names as n
from stepscope.traces.backend.source import TraceSource
from stepscope.viz.charts import (
    finish_step_chart,
    interval_bars,
    kv_group_figure,
    preemption_marks,
    step_markers,
    token_bars,
    token_hover,
)
from stepscope.viz.engine_data import (
    LATENCIES,
    STEP_COLUMNS,
    kv_group_series,
    latency_histograms,
    ranks_in,
    read_loads,
    read_requests,
    read_signature,
    read_step_requests,
    read_steps,
    read_timeline,
    request_cards,
    request_table,
    step_cards,
    step_series,
    timeline_bars,
    timeline_lanes,
    timeline_links,
    timeline_window,
)
from stepscope.viz.frames import fmt_ms, int_text
from stepscope.viz.rank_panel import RankPanel
from stepscope.viz.ui import (
    COLORS,
    CSS,
    NO_TRACE,
    bokeh_pane,
    cards,
    new_figure,
    new_table,
    outside_legend,
)

# The per-step charts' titles: tokens, KV blocks, queue (with several ranks, the rank follows).
STEP_TITLES = (
    "Tokens per step: decode vs prefill, and the token budget",
    "KV blocks after scheduling: used vs free",
    "Running and waiting requests",
)
# Shown only when the run's model has several KV cache groups (a hybrid model such as Gemma 3).
GROUPS_TITLE = "KV blocks held per KV cache group (windows give back what they left behind)"
BOUNDARY_COLORS = {
    n.API_TO_ENGINE_CORE: "#4C78A8",
    n.ENGINE_CORE_TO_WORKER: "#B279A2",
    n.WORKER_TO_ENGINE_CORE: "#9D755D",
    n.ENGINE_CORE_TO_API: "#E45756",
}
LATENCY_CHARTS = {  # key: (title, color)
    "ttft": ("Time to first token (ms)", COLORS["prefill"]),
    "itl": ("Inter-token latency (ms): (e2e − TTFT) / (output − 1)", COLORS["decode"]),
    "e2e": ("End-to-end latency (ms)", COLORS["free"]),
}


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
        self._step_summary: list[tuple[str, str, str]] = []  # readout cards of the steps
        self.summary = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.empty = pn.pane.Markdown(NO_TRACE, visible=source is None)
        self._build_step_charts()
        self._build_timeline()
        self._build_rank_panel()
        self._build_latencies()
        self._build_table()
        self._build_player()
        self.content = self._layout(visible=source is not None)
        self.panel = pn.Column(self.empty, self.content, sizing_mode="stretch_width")
        self.refresh()

    # -- building --
    def _build_step_charts(self) -> None:
        """Tokens and budget, KV blocks, queue: one x range, one replay marker each."""
        self.step_source = ColumnDataSource({k: [] for k in STEP_COLUMNS})
        self.preempt_source = ColumnDataSource(dict(step=[], y=[], count=[]))
        self.markers = step_markers(3)
        self.tokens_fig = self._tokens_figure()
        self.kv_fig = self._kv_figure()
        self.queue_fig = self._queue_figure()
        for fig, marker in zip(self._step_figs, self.markers, strict=True):
            fig.add_layout(marker)
        self.kv_fig.x_range = self.tokens_fig.x_range
        self.queue_fig.x_range = self.tokens_fig.x_range
        self.groups_source = ColumnDataSource(dict(xs=[], ys=[], label=[], color=[]))
        self.groups_fig = kv_group_figure(GROUPS_TITLE, self.groups_source)
        self.groups_fig.x_range = self.tokens_fig.x_range
        self.markers.extend(step_markers(1))
        self.groups_fig.add_layout(self.markers[-1])
        # Its own row, shown or hidden whole (a Bokeh pane's visibility follows its figure's).
        self.groups_box = pn.Row(
            bokeh_pane(self.groups_fig), sizing_mode="stretch_width", visible=False,
            css_classes=["eng-kv-groups"],
        )  # fmt: skip

    @property
    def _step_figs(self) -> tuple[figure, figure, figure]:
        return self.tokens_fig, self.kv_fig, self.queue_fig

    def _build_timeline(self) -> None:
        self.lane_bars = ColumnDataSource(
            dict(lane=[], left=[], right=[], color=[], label=[], step=[])
        )
        self.lane_links = ColumnDataSource(
            dict(x0=[], y0=[], x1=[], y1=[], boundary=[], color=[], label=[])
        )
        self.timeline_fig = self._timeline_figure()

    def _build_rank_panel(self) -> None:
        """With several DP ranks: each rank's work, and one line per rank over time."""
        self.rank_panel = RankPanel(on_select=self._select_rank)
        # Its parts under the page's names (the app's tests read them here).
        self.rank_box, self.rank_select = self.rank_panel.box, self.rank_panel.select
        self.rank_summary, self.rank_markers = self.rank_panel.summary, self.rank_panel.markers
        self.rank_lines = self.rank_panel.lines
        self.load_lines, self.lost_points = self.rank_panel.load_lines, self.rank_panel.lost_points

    def _build_latencies(self) -> None:
        self.hists = {key: ColumnDataSource(dict(left=[], right=[], count=[])) for key in LATENCIES}
        self.hist_figs = [self._histogram(key, *LATENCY_CHARTS[key]) for key in LATENCIES]

    def _build_table(self) -> None:
        """The request table; a selected row opens the request's path."""
        self.table = new_table(
            selectable=1,
            pagination="local",
            page_size=15,
            layout="fit_data_stretch",
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

    def _build_player(self) -> None:
        """The replay's step player and its read-out of the step."""
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

    def _layout(self, visible: bool) -> pn.Column:
        def row(*items: Any) -> pn.Row:
            return pn.Row(*items, sizing_mode="stretch_width")

        return pn.Column(
            self.summary,
            self.rank_box,
            row(self.rank_select, self.player, self.step_detail),
            row(bokeh_pane(self.tokens_fig), bokeh_pane(self.kv_fig)),
            self.groups_box,
            row(bokeh_pane(self.queue_fig), bokeh_pane(self.timeline_fig)),
            row(*[bokeh_pane(f) for f in self.hist_figs]),
            pn.pane.Markdown("#### Requests (click a row to open its path)"),
            self.table,
            sizing_mode="stretch_width",
            visible=visible,
        )

    # -- figures --
    def _tokens_figure(self) -> figure:
        fig = new_figure(
            STEP_TITLES[0], y_range=Range1d(0, 1), x_axis_label="step", y_axis_label="tokens"
        )
        bars = token_bars(fig, self.step_source, width=0.85)
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
        marks = preemption_marks(fig, self.preempt_source, size=12)
        token_hover(
            fig,
            bars,
            ("budget", "@budget"),
            ("duration", "@duration_ms{0.00} ms"),
            ("prefix-hit tokens", "@hits"),
        )
        fig.add_tools(HoverTool(renderers=[marks], tooltips=[("preempted", "@count at @step")]))
        outside_legend(fig)
        return fig

    def _kv_figure(self) -> figure:
        fig = new_figure(STEP_TITLES[1], x_axis_label="step", y_axis_label="blocks")
        areas = fig.varea_stack(
            ["used", "free"],
            x="step",
            source=self.step_source,
            color=[COLORS["used"], COLORS["free"]],
            legend_label=["used", "free"],
            alpha=0.85,
        )
        fig.line("step", "used", source=self.step_source, color="#2b6a99", line_width=1)
        finish_step_chart(fig, ["used", "free"], renderers=areas[:1])
        return fig

    def _queue_figure(self) -> figure:
        fig = new_figure(STEP_TITLES[2], x_axis_label="step", y_axis_label="requests")
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
        finish_step_chart(fig, ["running", "waiting"])
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
        bars = interval_bars(fig, self.lane_bars, "lane", 0.5, alpha=0.85)
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
        signature = read_signature(self.source)
        if signature == self.signature:
            return
        self.signature = signature
        steps = read_steps(self.source)
        requests = read_requests(self.source)
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
        self.ranks = ranks_in(steps, requests) or [0]
        self._step_summary = step_cards(steps, len(self.ranks))
        self._show_ranks(steps, requests)
        self._show_requests(requests)
        if self.dp_rank not in self.ranks:
            self.dp_rank = self.ranks[0]
        self.rank_panel.offer(self.ranks, self.dp_rank)  # calls _select_rank

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
        figs, titles = (*self._step_figs, self.groups_fig), (*STEP_TITLES, GROUPS_TITLE)
        for fig, title in zip(figs, titles, strict=True):
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
        if not self.several_ranks:
            self.rank_panel.clear()
            return
        assert self.source is not None
        self.rank_panel.show(steps, requests, read_loads(self.source), self.origin_ns or 0)

    def _show_steps(self, steps: pd.DataFrame) -> None:
        self.steps = steps
        groups = kv_group_series(steps)
        self.groups_source.data = groups
        self.groups_box.visible = bool(groups["xs"])
        if steps.empty:
            self.step_source.data = {k: [] for k in self.step_source.data}
            self.preempt_source.data = dict(step=[], y=[], count=[])
            return
        self.step_source.data, self.preempt_source.data, top = step_series(steps)
        self.tokens_fig.y_range.end = top * 1.12

    def _show_requests(self, requests: pd.DataFrame) -> None:
        for key, data in latency_histograms(requests).items():
            self.hists[key].data = data
        self.table.value = request_table(requests, self.several_ranks)
        self.summary.object = cards([*request_cards(requests), *self._step_summary])

    def _show_timeline(self, step: int | None) -> None:
        """Steps and crossings of TIMELINE_STEPS steps: the latest, or those around `step`."""
        steps = self.steps
        if steps.empty or self.source is None:
            return
        t0, t1 = timeline_window(steps, step, self.origin_ns)
        spans, links = read_timeline(self.source, t0, t1)
        origin = self.origin_ns or t0
        bars = timeline_bars(spans, origin, self.several_ranks)
        bars["color"] = [COLORS[kind] for kind in bars.pop("kind")]
        self.lane_bars.data = bars
        segments = timeline_links(links, origin, self.several_ranks)
        segments["color"] = [BOUNDARY_COLORS.get(b, COLORS["crossing"]) for b in links["boundary"]]
        self.lane_links.data = segments
        lanes = timeline_lanes(bars, segments, self.ranks, self.several_ranks)
        self.timeline_fig.y_range.factors = lanes
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
            self.rank_panel.mark(None)
            return
        origin = self.origin_ns or 0
        # Times from the columns: a row of mixed columns is float64, too coarse for ns.
        self.timeline_step.left = (int(row["start_ns"].iloc[0]) - origin) / 1e6
        self.timeline_step.right = (int(row["end_ns"].iloc[0]) - origin) / 1e6
        self.timeline_step.visible = True
        self.rank_panel.mark(self.timeline_step.left)
        served = read_step_requests(self.source, self.dp_rank, int(step))
        self.step_detail.object = step_detail_html(name, row.iloc[0], served)

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


def step_detail_html(name: str, r: pd.Series, served: pd.DataFrame) -> str:
    """The player's read-out of step `r` (called `name`) and the requests it `served`."""
    who = ", ".join(
        f"{rid} ({k})" for rid, k in zip(served["request_id"], served["num_tokens"], strict=True)
    )
    return (
        f'<div class="ss-formula" id="replay-step"><b>{name}</b>: '
        f"{int_text(r.num_decode_tokens)} decode + {int_text(r.num_prefill_tokens)} prefill of "
        f"{int_text(r.token_budget)}; KV free {int_text(r.kv_free_before)} → "
        f"{int_text(r.kv_free_after)} of {int_text(r.kv_total_blocks)}; running "
        f"{int_text(r.num_running)}, waiting {int_text(r.num_waiting)}; preempted "
        f"{int_text(r.num_preempted)}; {fmt_ms(r.duration_s, 2)}<br>"
        f"requests (tokens): {html.escape(who) or '-'}</div>"
    )
