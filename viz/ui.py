"""Shared look of the dashboard pages: colors, CSS, readout cards and Bokeh figure defaults."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd
import panel as pn
from bokeh.plotting import figure

# Handed on for the path page; they live in `frames` so that data modules go without Panel.
from stepscope.viz.frames import fmt_ms as fmt_ms
from stepscope.viz.frames import int_text as int_text

COLORS = {
    "decode": "#4C78A8",
    "prefill": "#F58518",
    "unused": "#E3E6EA",
    "refused": "#F9D3B0",
    "free": "#54A24B",
    "used": "#9ECAE9",
    "short": "#E45756",
    "preempt": "#E45756",
    "prefix": "#B279A2",
    "running": "#4C78A8",
    "waiting": "#F58518",
    "api": "#4C78A8",
    "engine core": "#F58518",
    "worker": "#54A24B",
    "crossing": "#7F7F7F",
}
# The parts of a request's end-to-end time (`traces.backend.explain.PARTS`), each its own colour,
# for "Why this long" and its legend: where the queue ends and prefill starts must show.
PART_COLORS = {
    "before_engine_s": "#2CA02C",
    "queue_s": "#C7C7C7",  # grey: nothing ran for it
    "prefill_s": COLORS["prefill"],
    "decode_s": COLORS["decode"],
    "preempted_s": "#B22222",  # deeper than COLORS["preempt"], which sits too near the orange
    "after_engine_s": "#E377C2",
}
NO_TRACE = """
### No trace loaded

The scheduler simulator works without one. To see real requests and steps, record a trace:

- a server: `stepscope serve --trace-db run.duckdb` (its collector serves this dashboard live);
- offline: `LLM(model=..., trace_db="run.duckdb")`, then
  `stepscope dashboard --db run.duckdb` to replay the finished file;
- a running collector: `stepscope dashboard --url http://127.0.0.1:4318`.
"""

TABLE_CSS = ".tabulator { font-size: 13px; }"
CSS = """
.ss-cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 4px 0 8px 0; }
.ss-card { border: 1px solid #dde2e8; border-radius: 8px; padding: 8px 14px; min-width: 118px;
           background: #fafbfc; }
.ss-card .label { font-size: 12px; color: #5b6673; }
.ss-card .value { font-size: 22px; font-weight: 600; color: #1f2d3d; }
.ss-card.ok { border-color: #54A24B; background: #f1f8f0; }
.ss-card.bad { border-color: #E45756; background: #fdf1f1; }
.ss-formula { font-family: ui-monospace, monospace; font-size: 13px; color: #33414e;
              line-height: 1.6; }
.ss-table { border-collapse: collapse; font-size: 13px; width: 100%; }
.ss-table th { text-align: left; background: #f1f3f5; padding: 6px 8px;
               border-bottom: 2px solid #dde2e8; }
.ss-table td { padding: 5px 8px; border-bottom: 1px solid #eceff2; vertical-align: top; }
.ss-table td.num { text-align: right; font-variant-numeric: tabular-nums; }
.ss-dot { display: inline-block; width: 10px; height: 10px; border-radius: 50%;
          margin-right: 6px; }
"""


# ---- helpers ------------------------------------------------------------------------------
def cards(items: list[tuple[str, str, str]], extra: str = "") -> str:
    """Readout cards: (key, label, value); `key` becomes the value's element id."""
    cards = "".join(
        f'<div class="ss-card {cls}"><div class="label">{html.escape(label)}</div>'
        f'<div class="value" id="ro-{key}">{html.escape(value)}</div></div>'
        for key, label, value, cls in ((*item, "") if len(item) == 3 else item for item in items)
    )
    return f'<div class="ss-cards">{cards}</div>{extra}'


def new_figure(title: str, height: int = 260, **kwargs: Any) -> figure:
    fig = figure(
        title=title,
        height=height,
        sizing_mode="stretch_width",
        tools="pan,xwheel_zoom,box_zoom,reset,save",
        toolbar_location="above",
        **kwargs,
    )
    fig.title.text_font_size = "13px"
    fig.title.text_color = "#1f2d3d"
    fig.outline_line_color = None
    fig.grid.grid_line_alpha = 0.4
    fig.min_border_left = 50
    return fig


def outside_legend(fig: figure, place: str = "above") -> None:
    """A horizontal legend outside the plot area, so it never hides data."""
    if fig.legend:
        legend = fig.legend[0]
        legend.orientation = "horizontal"
        legend.click_policy = "hide"
        legend.label_text_font_size = "11px"
        legend.padding = 2
        legend.margin = 2
        legend.border_line_alpha = 0
        fig.add_layout(legend, place)


def bokeh_pane(fig: figure) -> pn.pane.Bokeh:
    return pn.pane.Bokeh(fig, sizing_mode="stretch_width")


def new_table(**kwargs: Any) -> pn.widgets.Tabulator:
    """A read-only table without its index, in the pages' look; `kwargs` go to Tabulator."""
    return pn.widgets.Tabulator(
        pd.DataFrame(),
        disabled=True,
        show_index=False,
        sizing_mode="stretch_width",
        theme="simple",
        stylesheets=[TABLE_CSS],
        **kwargs,
    )
