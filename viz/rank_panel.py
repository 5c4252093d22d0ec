"""The engine page's data-parallel section (docs/dashboard.md, "Data-parallel ranks"): a table
of each rank's work and four charts with one line per rank over time, three from the engine
cores' step spans (`engine_data.rank_series`) and one from the load the DP coordinator published
(`engine_data.load_series`), plus the rank selector the page shows beside its player.

Shown only with several ranks; the page hands it frames it read (`show`) and the replayed step's
time (`mark`), and is told which rank was picked (`on_select`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import panel as pn
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure

from stepscope.viz.charts import step_markers
from stepscope.viz.engine_data import load_series, rank_color, rank_series, rank_table
from stepscope.viz.ui import CSS, bokeh_pane, new_figure, outside_legend

INTRO = (
    "#### Data-parallel ranks\n"
    "Each rank is an engine core with its own scheduler, KV cache and workers; the "
    "API server sends each request to the least-loaded rank, by the load the DP "
    "coordinator last published (the fourth chart: `dp_loads`). Step indexes count "
    "per rank: the per-step charts below show the rank picked beside the player."
)


class RankPanel:
    """Each DP rank's work (`summary`), its lines over time (`figs`) and the rank selector."""

    def __init__(self, on_select: Callable[[int], None]) -> None:
        self._on_select = on_select
        # Shaped from no rows: the sources' columns, empty.
        self.lines = ColumnDataSource(rank_series(pd.DataFrame(), 0))
        load_lines, lost_points = load_series(pd.DataFrame(), 0)
        self.load_lines = ColumnDataSource(load_lines)
        self.lost_points = ColumnDataSource(lost_points)
        self.markers = step_markers(4)
        self.figs = self._figures()
        self.summary = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.box = pn.Column(
            pn.pane.Markdown(INTRO),
            self.summary,
            *[
                pn.Row(*[bokeh_pane(f) for f in pair], sizing_mode="stretch_width")
                for pair in (self.figs[:2], self.figs[2:])
            ],
            sizing_mode="stretch_width",
            visible=False,
        )
        self.select = pn.widgets.Select(label="DP rank", options={}, width=140, visible=False)
        self.select.param.watch(lambda e: self._on_select(e.new), "value")

    # -- figures --
    def _figures(self) -> list[figure]:
        figs = [
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
        for fig, marker in zip(figs, self.markers, strict=True):
            fig.add_layout(marker)
            fig.x_range = figs[0].x_range
        return figs

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
        source = self.lines if source is None else source
        fig = new_figure(title, x_axis_label="ms since the first span", y_axis_label=y_label)
        styles = [(column, {"legend_field": "label"}), (dashed, {"line_dash": "dashed"})]
        lines = [
            fig.multi_line(xs="xs", ys=ys, source=source, line_color="color", line_width=2, **style)
            for ys, style in styles
            if ys is not None
        ]
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

    # -- data --
    def show(
        self, steps: pd.DataFrame, requests: pd.DataFrame, loads: pd.DataFrame, origin_ns: int
    ) -> None:
        """Every rank's steps, requests and published loads, times in ms since `origin_ns`."""
        self.box.visible = True
        self.lines.data = rank_series(steps, origin_ns)
        self.load_lines.data, self.lost_points.data = load_series(loads, origin_ns)
        self.summary.object = rank_table_html(rank_table(steps, requests, loads))

    def clear(self) -> None:
        """One rank: nothing to compare, the section hides."""
        self.box.visible = False
        for source in (self.lines, self.load_lines, self.lost_points):
            source.data = {k: [] for k in source.data}
        self.summary.object = ""

    def offer(self, ranks: list[int], dp_rank: int) -> None:
        """Offer `ranks` in the selector (shown with several) and pick `dp_rank`, which calls
        `on_select` whether or not it was picked already."""
        options = {f"rank {r}": r for r in ranks}
        if options != self.select.options:
            self.select.options = options
        self.select.visible = len(ranks) > 1
        if self.select.value != dp_rank:
            self.select.value = dp_rank  # the watcher calls on_select
        else:
            self._on_select(dp_rank)

    def mark(self, ms: float | None) -> None:
        """Mark the replayed step's start (ms) on the four charts, seen while the section is;
        None hides the marks."""
        for marker in self.markers:
            if ms is not None:
                marker.location = ms
            marker.visible = ms is not None and self.box.visible


def rank_table_html(table: pd.DataFrame) -> str:
    """`engine_data.rank_table` as an HTML table, each rank in its colour."""

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
