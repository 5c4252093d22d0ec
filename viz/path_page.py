"""Dashboard page 2: one request's way through the ten stages of docs/request-path.md, from its
spans.

The stage definitions and the span arithmetic live in `request_path`; this page draws them: a
waterfall of every occurrence of every stage, the request's headline numbers, and the stage table.
"Why this long" draws `traces.backend.explain.explain`, what `stepscope trace explain` prints.
"""

from __future__ import annotations

import html
import re

import pandas as pd
import panel as pn
from bokeh.models import ColumnDataSource, FactorRange, HoverTool, Span

from stepscope.traces.backend import explain, queries
from stepscope.traces.backend.source import TraceSource
from stepscope.traces.backend.units import format_seconds
from stepscope.traces.names import RequestEvent
from stepscope.viz.charts import interval_bars
from stepscope.viz.request_path import (
    STAGES,
    preemption_times,
    stage_occurrences,
    stage_summary,
)
from stepscope.viz.ui import (
    COLORS,
    CSS,
    NO_TRACE,
    PART_COLORS,
    bokeh_pane,
    cards,
    fmt_ms,
    int_text,
    new_figure,
    outside_legend,
)

MAX_REQUESTS = 5000  # requests offered in the picker (the most recent)
# The parts of a request's end-to-end time, in the request path's order, as "Why this long" draws
# them (and its legend names them), each in its own colour.
PART_LABELS = {
    part: (label, PART_COLORS[part])
    for part, label in (
        ("before_engine_s", "before the engine"),
        ("queue_s", "queue"),
        ("prefill_s", "prefill"),
        ("decode_s", "decode"),
        ("preempted_s", "preempted"),
        ("after_engine_s", "after the engine"),
    )
}
STAGE_KIND = {
    1: "api",
    2: "crossing",
    3: "engine core",
    4: "engine core",
    5: "crossing",
    6: "worker",
    7: "crossing",
    8: "engine core",
    9: "crossing",
    10: "api",
}


# ---- the page -----------------------------------------------------------------
class RequestPathPage:
    """The ten stages, each with the measured spans of one chosen request."""

    def __init__(self, source: TraceSource | None) -> None:
        self.source = source
        self.select = pn.widgets.Select(
            label="Request", options={}, width=420, css_classes=["path-request"]
        )
        self.header = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.stages = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.empty = pn.pane.Markdown(NO_TRACE if source is None else "", visible=False)
        labels = [f"{s.number} · {s.name}" for s in STAGES]
        self.bars = ColumnDataSource(
            dict(
                stage=[],
                left=[],
                right=[],
                mid=[],
                color=[],
                kind=[],
                step=[],
                rank=[],
                duration=[],
                detail=[],
                process=[],
            )
        )
        fig = new_figure(
            "Waterfall: every occurrence of each stage (ms since the request arrived)",
            height=420,
            y_range=FactorRange(*reversed(labels)),
            x_axis_label="ms since the request arrived",
        )
        bars = interval_bars(fig, self.bars, "stage", 0.55, legend_field="kind")
        # Crossings take microseconds: a marker keeps them visible at any zoom.
        marks = fig.scatter(
            x="mid", y="stage", color="color", size=7, marker="diamond", source=self.bars
        )
        fig.add_tools(
            HoverTool(
                renderers=[bars, marks],
                tooltips=[
                    ("stage", "@stage"),
                    ("process", "@process"),
                    ("step", "@step"),
                    ("rank", "@rank"),
                    ("time", "@duration"),
                    ("", "@detail"),
                ],
            )
        )
        self.event_lines = {
            name: Span(
                location=0,
                dimension="height",
                line_dash=dash,
                line_color=color,
                line_width=1.5,
                visible=False,
            )
            for name, dash, color in (
                (RequestEvent.FIRST_TOKEN, "dashed", "#2c7a2c"),
                (RequestEvent.SCHEDULED, "dotted", "#33414e"),
            )
        }
        for line in self.event_lines.values():
            fig.add_layout(line)
        self.preemptions = ColumnDataSource(dict(x=[], top=[], bottom=[], label=[]))
        cuts = fig.segment(
            x0="x",
            x1="x",
            y0="top",
            y1="bottom",
            source=self.preemptions,
            color=COLORS["preempt"],
            line_width=2,
            line_dash="dashed",
            legend_label="preempted",
        )
        fig.add_tools(HoverTool(renderers=[cuts], tooltips=[("", "@label")]))
        outside_legend(fig)
        self.fig = fig
        self.why_parts = ColumnDataSource(dict(y=[], left=[], right=[], color=[], part=[], ms=[]))
        why = new_figure(
            "Why this long: the end-to-end time, part by part (they add up)",
            height=150,
            y_range=FactorRange("request"),
            x_axis_label="ms since the request arrived",
        )
        why_bars = interval_bars(why, self.why_parts, "y", 0.6, legend_field="part")
        why.add_tools(HoverTool(renderers=[why_bars], tooltips=[("", "@part: @ms")]))
        outside_legend(why)
        self.why_fig = why
        self.why_text = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.select.param.watch(lambda e: self.show(e.new), "value")
        self.panel = pn.Column(
            pn.pane.Markdown(
                "A request goes through ten stages, four of them process boundaries (the table "
                "and the vLLM code behind each stage: `docs/request-path.md` in the stepscope "
                "repository). Pick a request: each stage below shows where it runs, what it "
                "does, the object that crosses, and the time measured from that request's "
                "spans. Stages 4 to 8 repeat once per step that served the request, stage 9 "
                "once per step that gave it tokens; the dashed green line is its first token.",
                sizing_mode="stretch_width",
            ),
            self.empty,
            self.select,
            self.header,
            bokeh_pane(why),
            self.why_text,
            bokeh_pane(fig),
            self.stages,
            sizing_mode="stretch_width",
        )
        self.refresh_options()

    def refresh_options(self) -> None:
        if self.source is None:
            self._set_empty(NO_TRACE)
            return
        try:
            frame = self.source.query(
                "SELECT request_id, input_tokens, output_tokens, e2e_s FROM requests "
                f"WHERE request_id IS NOT NULL ORDER BY start_ns DESC LIMIT {MAX_REQUESTS}"
            )
        except Exception as error:  # a collector that went away: say so, keep the page
            self._set_empty(f"Could not read requests: {error}")
            return
        if frame.empty:
            self._set_empty("No requests in this trace yet.")
            return
        self.empty.visible = False
        self.select.visible = True
        options = {
            f"{r.request_id}  ({int_text(r.input_tokens)} in, {int_text(r.output_tokens)} out, "
            f"{fmt_ms(r.e2e_s)})": r.request_id
            for r in frame.itertuples(index=False)
        }
        if options != self.select.options:
            current = self.select.value
            self.select.options = options
            if current in options.values():
                self.select.value = current
                self.show(current)  # the trace grew (live): redraw its path
        if self.select.value is None or self.select.value not in options.values():
            self.select.value = next(iter(options.values()))

    def _set_empty(self, text: str) -> None:
        self.empty.object = text
        self.empty.visible = True
        self.select.visible = False

    def show(self, request_id: str | None) -> None:
        if request_id is None or self.source is None:
            return
        if self.select.value != request_id:
            self.select.value = request_id  # calls back into show()
            return
        try:
            request, occ = stage_occurrences(self.source, request_id)
        except KeyError:
            return
        start = request["start_ns"]
        kinds = [STAGE_KIND[s] for s in occ["stage"]]
        left = (occ["start_ns"] - start) / 1e6
        right = (occ["end_ns"] - start) / 1e6
        self.bars.data = dict(
            stage=[f"{s} · {name}" for s, name in zip(occ["stage"], occ["name"], strict=True)],
            left=left.to_numpy(float),
            right=right.to_numpy(float),
            mid=((left + right) / 2).to_numpy(float),
            color=[COLORS[k] for k in kinds],
            kind=kinds,
            step=["-" if pd.isna(v) else str(int(v)) for v in occ["step"]],
            rank=["-" if pd.isna(v) else str(int(v)) for v in occ["rank"]],
            duration=[
                f"{(e - s) / 1e3:.1f} µs"
                for s, e in zip(occ["start_ns"], occ["end_ns"], strict=True)
            ],
            detail=list(occ["detail"]),
            process=[STAGES[s - 1].process for s in occ["stage"]],
        )
        for name, line in self.event_lines.items():
            value = request.get(f"{name}_ns")  # the `requests` view's column
            line.visible = value is not None
            if value is not None:
                line.location = (value - start) / 1e6
        cuts = [(t - start) / 1e6 for t in preemption_times(self.source, request)]
        first, last = f"1 · {STAGES[0].name}", f"{len(STAGES)} · {STAGES[-1].name}"
        self.preemptions.data = dict(
            x=cuts,
            top=[first] * len(cuts),
            bottom=[last] * len(cuts),
            label=[f"preempted at {x:.2f} ms: blocks freed, recomputed later" for x in cuts],
        )
        num_steps = occ.loc[occ["stage"] == 4, "step"].nunique()
        # With data parallelism: the rank the request was sent to (its steps are that rank's).
        several = len(queries.dp_ranks(self.source)) > 1
        rank = [("req-dp-rank", "DP rank", int_text(request.get("dp_rank")))] if several else []
        self.header.object = cards(
            [
                ("req-id", "request", request_id),
                *rank,
                (
                    "req-tokens",
                    "prompt / output tokens",
                    f"{int_text(request['input_tokens'])} / {int_text(request['output_tokens'])}",
                ),
                ("req-queue", "queue", fmt_ms(request["queue_time_s"], 2)),
                ("req-ttft", "time to first token", fmt_ms(request["ttft_s"], 2)),
                ("req-e2e", "end to end", fmt_ms(request["e2e_s"], 2)),
                ("req-steps", "steps that served it", str(num_steps)),
                ("req-cached", "prefix-cache tokens", int_text(request["cached_tokens"])),
                ("req-preempt", "preemptions", int_text(request["num_preemptions"])),
                ("req-finish", "finish", str(request["finish_reason"] or "-")),
            ]
        )
        self.stages.object = _stage_table(stage_summary(occ))
        self._show_why(request_id)

    def _show_why(self, request_id: str) -> None:
        """The explain answer: a stacked bar of the parts, the queue by reason, the sentence."""
        result = explain.explain(self.source, request_id)
        left, rows = 0.0, dict(y=[], left=[], right=[], color=[], part=[], ms=[])
        for key, (label, color) in PART_LABELS.items():
            ms = result["parts"][key] * 1e3
            rows["y"].append("request")
            rows["left"].append(left)
            rows["right"].append(left + ms)
            rows["color"].append(color)
            rows["part"].append(label)
            rows["ms"].append(format_seconds(result["parts"][key]))
            left += ms
        self.why_parts.data = rows
        reasons = ", ".join(
            f"{html.escape(reason)} {format_seconds(seconds)}"
            for reason, seconds in sorted(result["queue_reasons"].items(), key=lambda kv: -kv[1])
        )
        shared = result["shared"]
        self.why_text.object = (
            f'<p id="why-summary"><b>{html.escape(result["summary"])}</b></p>'
            f'<p id="why-queue">Queue by reason: {reasons or "none"}. '
            f"Steps that ran it: {shared['steps']}, with its {shared['own_tokens']} tokens and "
            f"others' {shared['other_prefill_tokens']} prefill + "
            f"{shared['other_decode_tokens']} decode tokens (about "
            f"{format_seconds(shared['interference_s'])} of their time by the token mix). "
            f"{_cpu_words(result['cpu'])}"
            "<small>The same answer as <code>stepscope trace explain TRACE "
            f"{html.escape(request_id)}</code>.</small></p>"
        )


def _cpu_words(cpu: dict) -> str:
    """The CPU its steps' worker got, measured, beside their wall time."""
    if cpu["cpu_share"] is None:
        return ""
    verdict = " (the machine was busy with something else)" if cpu["contention"] else ""
    return (
        f"Its steps' worker got {cpu['cpu_share']:.0%} of the CPU time its "
        f"{cpu['num_threads']} threads could use, {cpu['cpu_cores']:.2f} cores{verdict}. "
    )


def _code(text: str) -> str:
    """`backticks` -> <code>, the rest escaped."""
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(text))


def _stage_table(summary: pd.DataFrame) -> str:
    rows = []
    for r in summary.itertuples(index=False):
        color = COLORS[STAGE_KIND[r.stage]]
        first = "-" if r.first_ms is None or pd.isna(r.first_ms) else f"{r.first_ms:.3f}"
        total = "-" if r.total_ms is None or pd.isna(r.total_ms) else f"{r.total_ms:.3f}"
        rows.append(
            f'<tr id="stage-{r.stage}"><td class="num">{r.stage}</td>'
            f'<td><span class="ss-dot" style="background:{color}"></span>'
            f"<b>{html.escape(r.name)}</b></td><td>{html.escape(r.process)}</td>"
            f"<td>{html.escape(r.action)}</td><td>{html.escape(r.crosses)}</td>"
            f'<td class="num">{r.times}</td><td class="num">{first}</td>'
            f'<td class="num">{total}</td><td><small>{_code(r.measured_by)}</small></td></tr>'
        )
    head = (
        "<tr><th>#</th><th>stage</th><th>process</th><th>action</th><th>object that crosses</th>"
        "<th>times</th><th>first (ms)</th><th>total (ms)</th><th>measured by</th></tr>"
    )
    return f'<table class="ss-table">{head}{"".join(rows)}</table>'
