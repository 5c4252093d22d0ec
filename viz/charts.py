"""Chart pieces more than one chart draws: the decode/prefill token bars with their
preemption marks and hover (the simulator's many-steps chart and the engine page's token chart),
the per-step hover and finish of the engine page's step charts, the replay's step markers, and
the horizontal interval bars of every timeline (lanes, the request's stages, its parts, blocks),
and the lines of blocks held per KV cache group (the engine page's and the simulator's).

Each piece draws on a figure from `ui.new_figure`, reading the column names its docstring gives
from the source it is handed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bokeh.models import ColumnDataSource, GlyphRenderer, HoverTool, Span
from bokeh.plotting import figure

from stepscope.viz.ui import COLORS, new_figure, outside_legend


def token_bars(
    fig: figure,
    source: ColumnDataSource,
    width: float,
    labels: tuple[str, str] = ("decode", "prefill"),
) -> list[GlyphRenderer]:
    """Decode and prefill tokens per step, stacked (columns `step`, `decode`, `prefill`)."""
    return fig.vbar_stack(
        ["decode", "prefill"],
        x="step",
        width=width,
        source=source,
        color=[COLORS["decode"], COLORS["prefill"]],
        legend_label=list(labels),
    )


def interval_bars(
    fig: figure, source: ColumnDataSource, y: str, height: float, **style: Any
) -> GlyphRenderer:
    """One horizontal bar per row, from `left` to `right` on the row named by column `y`, in the
    row's `color`; `style` adds glyph options (`legend_field`, `alpha`)."""
    return fig.hbar(
        y=y, left="left", right="right", height=height, color="color", source=source, **style
    )


def preemption_marks(fig: figure, source: ColumnDataSource, size: int) -> GlyphRenderer:
    """A triangle above the bars at each step that preempted (columns `step`, `y`)."""
    return fig.scatter(
        "step",
        "y",
        source=source,
        marker="inverted_triangle",
        size=size,
        color=COLORS["preempt"],
        legend_label="preemption",
    )


def token_hover(fig: figure, renderers: Sequence[GlyphRenderer], *more: tuple[str, str]) -> None:
    """A step's decode and prefill tokens (and `more` tooltips) over `renderers`."""
    tooltips = [("step", "@step"), ("decode", "@decode"), ("prefill", "@prefill"), *more]
    fig.add_tools(HoverTool(renderers=list(renderers), tooltips=tooltips))


def finish_step_chart(
    fig: figure, columns: Sequence[str], renderers: Sequence[GlyphRenderer] | None = None
) -> None:
    """A hover listing the step and `columns` at the pointer's step (over `renderers`, default
    all), the y axis from 0 and the legend outside."""
    tooltips = [("step", "@step"), *((column, f"@{column}") for column in columns)]
    hover: dict[str, Any] = {} if renderers is None else {"renderers": list(renderers)}
    fig.add_tools(HoverTool(tooltips=tooltips, mode="vline", **hover))
    fig.y_range.start = 0
    outside_legend(fig)


def step_markers(count: int) -> list[Span]:
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


def kv_group_figure(title: str, source: ColumnDataSource) -> figure:
    """Blocks each KV cache group holds over the steps, one line per group (columns `xs`, `ys`,
    `label`, `color`: engine_data.kv_group_series), the legend to the right, one name a line."""
    fig = new_figure(title, x_axis_label="step", y_axis_label="blocks held")
    lines = fig.multi_line(
        "xs", "ys", source=source, color="color", legend_field="label", line_width=2
    )
    tooltips = [("", "@label"), ("step", "$data_x{0}"), ("blocks", "$data_y{0}")]
    fig.add_tools(HoverTool(renderers=[lines], tooltips=tooltips))
    fig.y_range.start = 0
    outside_legend(fig, "right")
    if fig.legend:
        fig.legend[0].orientation = "vertical"
    return fig
