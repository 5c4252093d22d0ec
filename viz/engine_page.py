"""Dashboard page 3: the engine step by step, from the `steps`, `requests`, `crossings` views.

Per-step token budget (decode vs prefill), KV blocks used and free, running and waiting counts,
preemptions, a timeline of steps per process with the messages between them, latency
histograms, and a request table whose rows open the request path page. A finished file is
replayed with a step player; a live source is re-read by the app every second.
"""

from __future__ import annotations

import html
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
           prefix_hit_tokens, num_preempted, num_finished
    FROM steps ORDER BY start_ns DESC LIMIT {MAX_STEPS}
) ORDER BY start_ns
"""
_REQUESTS_SQL = f"""
SELECT request_id, start_ns, input_tokens, output_tokens, cached_tokens, num_preemptions,
       queue_time_s, ttft_s, e2e_s, finish_reason
FROM requests WHERE request_id IS NOT NULL ORDER BY start_ns DESC LIMIT {MAX_REQUESTS}
"""
_TIMELINE_SPANS_SQL = f"""
SELECT name, service_name, rank, start_ns, end_ns,
       CAST(json_extract(attributes, '$."{n.STEP}"') AS BIGINT) AS step
FROM spans
WHERE name IN ('{n.ENGINE_STEP}', '{n.WORKER_STEP}') AND start_ns BETWEEN $1 AND $2
"""
_TIMELINE_CROSSINGS_SQL = """
WITH c AS (SELECT * FROM crossings WHERE start_ns BETWEEN $1 AND $2)
SELECT s.boundary, s.message_type, s.bytes, s.num_requests, s.start_ns AS send_ns,
       r.end_ns AS recv_ns, s.service_name AS src_service, s.rank AS src_rank,
       r.service_name AS dst_service, r.rank AS dst_rank
FROM c s JOIN c r ON r.parent_span_id = s.span_id AND r.trace_id = s.trace_id
WHERE s.side = 'send' AND r.side = 'receive'
"""
_SIGNATURE_SQL = "SELECT count(*) AS spans, max(end_ns) AS last_ns FROM spans"
_STEP_REQUESTS_SQL = "SELECT request_id, num_tokens FROM step_requests WHERE step = $1"


def _lane(service: Any, rank: Any) -> str:
    if service == n.SERVICE_API:
        return "API server"
    if service == n.SERVICE_ENGINE_CORE:
        return "engine core"
    if service == n.SERVICE_WORKER:
        return f"worker {int_text(rank)}"
    return str(service)


def _lane_order(lane: str) -> tuple[int, str]:
    order = {"API server": 0, "engine core": 1}
    return (order.get(lane, 2), lane)


class EnginePage:
    """Per-step budget, KV usage, queues and preemptions; a process timeline; latencies."""

    def __init__(self, source: TraceSource | None, open_request: Callable[[str], None]) -> None:
        self.source = source
        self.open_request = open_request
        self.signature: tuple[Any, ...] | None = None
        self.origin_ns: int | None = None
        self.steps = pd.DataFrame()
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
        self.markers = [
            Span(
                location=0,
                dimension="height",
                line_color="#33414e",
                line_width=1.5,
                line_dash="dashed",
                visible=False,
            )
            for _ in range(3)
        ]
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
            pn.Row(self.player, self.step_detail, sizing_mode="stretch_width"),
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
        self._show_steps(steps)
        self._show_requests(requests, steps)
        if self.source.live or steps.empty:
            self.player.visible = False
            self._show_timeline(None)
        else:
            self.player.visible = True
            self.player.start = int(steps["step"].min())
            self.player.end = max(int(steps["step"].max()), self.player.start + 1)
            self.show_step(
                self.player.value if self.player.value >= self.player.start else self.player.start
            )

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

        used_share = np.nanmean(
            tokens / np.where(cols["token_budget"] > 0, cols["token_budget"], np.nan)
        )
        self._step_summary = [
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
        # Lanes by role, not process: an offline run does every role in one process.
        kinds = ["engine core" if name == n.ENGINE_STEP else "worker" for name in spans["name"]]
        lanes = [
            kind if kind == "engine core" else _lane(n.SERVICE_WORKER, rank)
            for kind, rank in zip(kinds, spans["rank"], strict=True)
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
        src = [_lane(s, r) for s, r in zip(links["src_service"], links["src_rank"], strict=True)]
        dst = [_lane(s, r) for s, r in zip(links["dst_service"], links["dst_rank"], strict=True)]
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
        all_lanes = sorted(set(lanes) | set(src) | set(dst) | {"engine core"}, key=_lane_order)
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
        if row.empty:
            self.step_detail.object = f'<i id="replay-step">step {step}: not traced</i>'
            return
        r = row.iloc[0]
        origin = self.origin_ns or 0
        self.timeline_step.left = (int(r.start_ns) - origin) / 1e6
        self.timeline_step.right = (int(r.end_ns) - origin) / 1e6
        self.timeline_step.visible = True
        served = self.source.query(_STEP_REQUESTS_SQL, [int(step)])
        who = ", ".join(
            f"{rid} ({k})"
            for rid, k in zip(served["request_id"], served["num_tokens"], strict=True)
        )
        self.step_detail.object = (
            f'<div class="ss-formula" id="replay-step"><b>step {step}</b>: '
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
