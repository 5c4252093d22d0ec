"""Dashboard page 1: how one step's batch is chosen (docs/request-path.md, section 4), computed
by the real scheduler.

Three sliders (running decode requests, waiting prompt length, free KV blocks) plus the step's
settings and the worked examples' presets drive `simulator.simulate_step` (one real `schedule()`)
and `simulator.simulate_steps` (many real steps), whose answers are shown as readouts and charts.
A layer pattern picks the KV cache groups: all full attention (one group), or Gemma 3's five
sliding-window layers to one full-attention layer, whose many-steps run adds a chart of the
blocks each group holds.
"""

from __future__ import annotations

import html
from typing import Any

import pandas as pd
import panel as pn
from bokeh.models import ColumnDataSource, FactorRange, HoverTool, LinearAxis, Range1d, Span
from bokeh.plotting import figure

from stepscope.viz.charts import (
    interval_bars,
    kv_group_figure,
    preemption_marks,
    token_bars,
    token_hover,
)
from stepscope.viz.engine_data import kv_group_labels, kv_group_series
from stepscope.viz.simulator import (
    GROUP_A,
    GROUP_B,
    LAYER_PATTERNS,
    WALKTHROUGH_SETTINGS,
    SimStep,
    StepResult,
    simulate_step,
    simulate_steps,
)
from stepscope.viz.ui import COLORS, CSS, cards, new_figure, new_table, outside_legend

# ---- presets ------------------------------------------------------------
PRESETS: dict[str, dict[str, int]] = {
    "Example settings (2048 / 64 / 256)": dict(WALKTHROUGH_SETTINGS),
    "Group A: admitted": {**WALKTHROUGH_SETTINGS, **GROUP_A},
    "Group B: short by 14 blocks": {**WALKTHROUGH_SETTINGS, **GROUP_B},
    "Small pool: chunks, prefix hit, preemption": {
        "budget": 128,
        "block_size": 16,
        "max_num_seqs": 256,
        "running": 4,
        "prompt_len": 480,
        "free_blocks": 36,
        "num_steps": 24,
        "output_len": 16,
        "repeat_at": 4,
    },
    "Gemma 3 layers: windows give blocks back": {
        "budget": 256,
        "block_size": 32,
        "max_num_seqs": 256,
        "running": 2,
        "prompt_len": 2000,
        "free_blocks": 800,
        "num_steps": 40,
        "output_len": 32,
        "repeat_at": 12,
    },
}
# The layer pattern a preset sets (the others keep the one chosen).
PRESET_LAYERS = {"Gemma 3 layers: windows give blocks back": list(LAYER_PATTERNS)[1]}
GROUPS_TITLE = "Many steps: KV blocks each KV cache group holds"


class SimulatorPage:
    """The three sliders of the budget walkthrough, computed by the real scheduler, one step and
    many."""

    def __init__(self) -> None:
        def slider(label: str, css: str, start: int, end: int, value: int) -> pn.widgets.IntSlider:
            return pn.widgets.IntSlider(
                label=label, start=start, end=end, value=value, css_classes=[css],
                sizing_mode="stretch_width",
            )  # fmt: skip

        def number(label: str, css: str, start: int, end: int, value: int, step: int = 1):
            return pn.widgets.IntInput(
                label=label, start=start, end=end, value=value, step=step, css_classes=[css],
                width=150,
            )  # fmt: skip

        # label, CSS class (the browser tests find widgets by it), start, end, value
        self.running = slider("Running decode requests", "sim-running", 0, 512, 64)
        self.prompt_len = slider("Waiting prompt length (tokens)", "sim-prompt", 1, 16384, 3968)
        self.free_blocks = slider("Free KV blocks", "sim-free", 0, 1024, 64)
        self.budget = number("Token budget", "sim-budget", 1, 65536, 2048, step=64)
        self.block_size = number("Block size", "sim-block-size", 2, 1024, 64, step=16)
        self.max_num_seqs = number("max_num_seqs", "sim-max-seqs", 1, 8192, 256)
        self.layers = pn.widgets.Select(
            label="Layer pattern (KV cache groups)", options=list(LAYER_PATTERNS),
            css_classes=["sim-layers"], width=300,
        )  # fmt: skip
        self.presets = [
            pn.widgets.Button(label=name, color="primary", variant="outline") for name in PRESETS
        ]
        for button in self.presets:
            button.on_click(lambda event, name=button.label: self.apply_preset(name))

        self.num_steps = number("Steps", "sim-steps", 1, 100, 24)
        self.output_len = number("Tokens to generate", "sim-output-len", 1, 1024, 8)
        self.repeat = pn.widgets.Checkbox(label="Same prompt again at step", value=True)
        self.repeat_at = pn.widgets.IntInput(label="", value=3, start=0, end=99, width=80)
        self.prefix_caching = pn.widgets.Checkbox(label="Prefix caching", value=True)

        self.readouts = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.budget_source = ColumnDataSource(
            dict(row=[], decode=[], chunk=[], refused=[], unused=[])
        )
        self.blocks_source = ColumnDataSource(dict(row=[], left=[], right=[], color=[], label=[]))
        self.budget_fig, self.blocks_fig = self._bars()

        self.steps_source = ColumnDataSource(
            dict(step=[], decode=[], prefill=[], free=[], top=[], preempted=[], hits=[])
        )
        self.preempt_source = ColumnDataSource(dict(step=[], y=[], label=[]))
        self.hit_source = ColumnDataSource(dict(step=[], y=[], label=[]))
        self.steps_fig, self.budget_line = self._steps_figure()
        self.groups_source = ColumnDataSource(dict(xs=[], ys=[], label=[], color=[]))
        self.groups_fig = kv_group_figure(GROUPS_TITLE, self.groups_source)
        self.groups_fig.x_range = self.steps_fig.x_range
        # Shown whole or not at all (a Bokeh pane's visibility follows its figure's).
        self.groups_box = pn.Column(
            pn.pane.Bokeh(self.groups_fig, sizing_mode="stretch_width"),
            sizing_mode="stretch_width", visible=False, css_classes=["sim-kv-groups"],
        )  # fmt: skip
        self.steps_table = new_table(height=320, layout="fit_data_fill")
        self.story = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.error = pn.pane.Alert("", alert_type="danger", visible=False)

        self._holding = False
        one_step = [
            self.running,
            self.prompt_len,
            self.free_blocks,
            self.budget,
            self.block_size,
            self.max_num_seqs,
            self.layers,
        ]
        multi = [self.num_steps, self.output_len, self.repeat, self.repeat_at, self.prefix_caching]
        for widget in one_step + multi:
            widget.param.watch(self._changed, "value")
        self.update()
        self.panel = self._layout()

    # -- layout --
    def _bars(self) -> tuple[figure, figure]:
        budget = new_figure(
            "This step's token budget",
            height=150,
            x_range=Range1d(0, 2048),
            y_range=FactorRange("tokens"),
        )
        budget.toolbar_location = None
        budget.hbar_stack(
            ["decode", "chunk", "refused", "unused"],
            y="row",
            height=0.6,
            source=self.budget_source,
            color=[COLORS["decode"], COLORS["prefill"], COLORS["refused"], COLORS["unused"]],
            legend_label=[
                "decode (1 token each)",
                "first prefill chunk",
                "chunk not admitted",
                "unused",
            ],
        )
        budget.add_tools(
            HoverTool(
                tooltips=[
                    ("decode", "@decode"),
                    ("first chunk", "@chunk"),
                    ("not admitted", "@refused"),
                    ("unused", "@unused"),
                ]
            )
        )
        outside_legend(budget, "below")
        budget.y_range.range_padding = 0.3
        blocks = new_figure(
            "KV blocks: free vs needed by the first chunk",
            height=170,
            x_range=Range1d(0, 70),
            y_range=FactorRange("needed", "free"),
        )
        blocks.toolbar_location = None
        interval_bars(blocks, self.blocks_source, "row", 0.6, legend_field="label")
        blocks.add_tools(HoverTool(tooltips=[("", "@label: @left to @right")]))
        outside_legend(blocks, "below")
        return budget, blocks

    def _steps_figure(self) -> tuple[figure, Span]:
        fig = new_figure(
            "Many steps: tokens scheduled per step, free KV blocks",
            height=330,
            y_range=Range1d(0, 2560),
            x_axis_label="step",
            y_axis_label="tokens",
        )
        bars = token_bars(fig, self.steps_source, 0.8, ("decode tokens", "prefill tokens"))
        budget_line = Span(
            location=2048,
            dimension="width",
            line_dash="dashed",
            line_color="#33414e",
            line_width=1.5,
        )
        fig.add_layout(budget_line)
        fig.extra_y_ranges = {"blocks": Range1d(0, 100)}
        fig.add_layout(LinearAxis(y_range_name="blocks", axis_label="free KV blocks"), "right")
        free = {"y_range_name": "blocks", "source": self.steps_source, "color": COLORS["free"]}
        line = fig.line("step", "free", line_width=2, legend_label="free blocks (after)", **free)
        fig.scatter("step", "free", size=5, **free)
        preempt = preemption_marks(fig, self.preempt_source, size=14)
        hits = fig.scatter(
            "step",
            "y",
            source=self.hit_source,
            marker="star",
            size=15,
            color=COLORS["prefix"],
            legend_label="prefix-cache hit",
        )
        token_hover(fig, [*bars, line], ("free blocks", "@free"))
        fig.add_tools(HoverTool(renderers=[preempt, hits], tooltips=[("", "@label")]))
        outside_legend(fig)
        return fig, budget_line

    def _layout(self) -> pn.viewable.Viewable:
        controls = pn.Column(
            pn.pane.HTML("<b>Presets</b>"),
            pn.FlexBox(*self.presets),
            pn.pane.HTML("<b>The walkthrough's three sliders</b> (and the step's settings)"),
            self.running,
            self.prompt_len,
            self.free_blocks,
            pn.Row(self.budget, self.block_size, self.max_num_seqs),
            self.layers,
            sizing_mode="stretch_width",
        )
        intro = pn.pane.Markdown(
            "With this many running decodes, does a waiting prompt get into the next step? "
            "Every number below comes from one real `schedule()` of stepscope's `Scheduler` and "
            "`KVCacheManager`, set up in that state (each decode part way through a block, "
            "prefix caching off). The budget loop behind it, and the vLLM code it mirrors: "
            "`docs/request-path.md`, section 4, in the stepscope repository.",
            sizing_mode="stretch_width",
        )
        one_step = pn.Column(
            intro,
            pn.Row(
                controls,
                pn.Column(
                    self.readouts, self.budget_fig, self.blocks_fig, sizing_mode="stretch_width"
                ),
                sizing_mode="stretch_width",
            ),
            sizing_mode="stretch_width",
        )
        many = pn.Column(
            pn.pane.Markdown(
                "### What one step cannot show\n"
                "The same state run for many real steps (`schedule()` then "
                "`update_from_output()` with stand-in sampled tokens): the prompt `p0` is "
                "prefilled in chunks, decodes cross into new blocks, a second request `p1` with "
                "the same prompt hits the prefix cache, and when the pool runs dry the "
                "last-admitted request is preempted and recomputed later. With Gemma 3's "
                "layers, the blocks each KV cache group holds: the sliding-window groups stay "
                "flat, giving back what their window left behind, while the full-attention "
                "group grows with every chunk.",
                sizing_mode="stretch_width",
            ),
            pn.Row(
                self.num_steps,
                self.output_len,
                pn.Column(pn.Spacer(height=22), self.repeat),
                self.repeat_at,
                pn.Column(pn.Spacer(height=22), self.prefix_caching),
            ),
            self.error,
            self.steps_fig,
            self.groups_box,
            self.story,
            self.steps_table,
            sizing_mode="stretch_width",
        )
        return pn.Column(one_step, pn.layout.Divider(), many, sizing_mode="stretch_width")

    # -- behaviour --
    def apply_preset(self, name: str) -> None:
        preset = PRESETS[name]
        self._holding = True
        try:
            for key, widget in (
                ("budget", self.budget),
                ("block_size", self.block_size),
                ("max_num_seqs", self.max_num_seqs),
                ("running", self.running),
                ("prompt_len", self.prompt_len),
                ("free_blocks", self.free_blocks),
                ("num_steps", self.num_steps),
                ("output_len", self.output_len),
                ("repeat_at", self.repeat_at),
            ):
                if key in preset:
                    widget.value = preset[key]
            if "repeat_at" in preset:
                self.repeat.value = True
            if name in PRESET_LAYERS:
                self.layers.value = PRESET_LAYERS[name]
        finally:
            self._holding = False
        self.update()

    def _changed(self, *_: Any) -> None:
        if not self._holding:
            self.update()

    def _settings(self) -> dict[str, int]:
        return dict(
            running=self.running.value,
            prompt_len=self.prompt_len.value,
            free_blocks=self.free_blocks.value,
            budget=self.budget.value or 1,
            block_size=max(self.block_size.value or 2, 2),
            max_num_seqs=self.max_num_seqs.value or 1,
        )

    def _pattern(self) -> dict[str, Any]:
        """The chosen layer pattern as `simulate_step`'s `layer_types` and `sliding_window`."""
        pattern = LAYER_PATTERNS[self.layers.value]
        if pattern is None:
            return {}
        return dict(layer_types=pattern[0], sliding_window=pattern[1])

    def update(self) -> None:
        settings = self._settings()
        try:
            result = simulate_step(**settings, **self._pattern())
            steps = simulate_steps(
                **settings,
                **self._pattern(),
                num_steps=self.num_steps.value or 1,
                output_len=self.output_len.value or 1,
                repeat_prompt_at=self.repeat_at.value if self.repeat.value else None,
                prefix_caching=self.prefix_caching.value,
            )
        except ValueError as error:
            self.error.object = str(error)
            self.error.visible = True
            return
        self.error.visible = False
        self._show_step(result)
        self._show_steps(steps, settings["budget"])

    def _show_step(self, r: StepResult) -> None:
        if r.admitted:
            verdict, cls = "admitted", "ok"
        elif r.prefill_budget == 0:
            verdict, cls = "no budget left", "bad"
        elif r.blocked_by_max_seqs:
            verdict, cls = "blocked by max seqs", "bad"
        else:
            verdict, cls = f"short by {r.blocks_short} blocks", "bad"
        chunks = "-" if r.num_chunks is None else str(r.num_chunks)
        cmp = "≤" if r.first_chunk_blocks <= r.free_blocks else ">"
        num_groups = len(r.kv_blocks_by_group)
        groups = f"{num_groups} KV cache groups × " if num_groups > 1 else ""
        free_now = r.free_blocks  # decodes sit mid-block: they take none of these
        formula = (
            f'<div class="ss-formula">'
            f"decode = min(running {r.running}, budget {r.budget}) = {r.decode_tokens}<br>"
            f"prefill budget = {r.budget} − {r.decode_tokens} = {r.prefill_budget}<br>"
            f"first chunk = min(prompt {r.prompt_len}, {r.prefill_budget}) = {r.first_chunk}"
            f"; chunks = ⌈{r.prompt_len} / {r.prefill_budget}⌉ = {chunks}<br>"
            f"blocks = {groups}⌈{r.first_chunk} / {r.block_size}⌉ = {r.first_chunk_blocks} {cmp} "
            f"{free_now} free; running {r.running} vs max_num_seqs {r.max_num_seqs} "
            f"→ <b>{html.escape(r.verdict)}</b></div>"
        )
        self.readouts.object = cards(
            [
                ("decode_tokens", "decode tokens", str(r.decode_tokens)),
                ("prefill_budget", "prefill budget", str(r.prefill_budget)),
                ("first_chunk", "first chunk", str(r.first_chunk)),
                ("num_chunks", "chunks", chunks),
                ("first_chunk_blocks", "blocks for first chunk", str(r.first_chunk_blocks)),
                ("verdict", "waiting request", verdict, cls),
            ],
            formula,
        )
        self.budget_source.data = dict(
            row=["tokens"],
            decode=[r.decode_tokens],
            chunk=[r.first_chunk if r.admitted else 0],
            refused=[0 if r.admitted else r.first_chunk],
            unused=[max(r.budget - r.decode_tokens - r.first_chunk, 0)],
        )
        self.budget_fig.x_range.end = r.budget
        bars = [
            ("free", 0, r.free_blocks, COLORS["free"], "free"),
            (
                "needed",
                0,
                min(r.first_chunk_blocks, r.free_blocks),
                COLORS["prefill"],
                "needed, available",
            ),
        ]
        if r.first_chunk_blocks > r.free_blocks:
            bars.append(
                ("needed", r.free_blocks, r.first_chunk_blocks, COLORS["short"], "needed, missing")
            )
        self.blocks_source.data = dict(
            zip(
                ("row", "left", "right", "color", "label"),
                map(list, zip(*bars, strict=True)),
                strict=True,
            )
        )
        self.blocks_fig.x_range.end = max(r.free_blocks, r.first_chunk_blocks, 1) * 1.05

    def _show_steps(self, steps: list[SimStep], budget: int) -> None:
        top = budget * 1.08
        self.steps_source.data = dict(
            step=[s.step for s in steps],
            decode=[s.decode_tokens for s in steps],
            prefill=[s.prefill_tokens for s in steps],
            free=[s.kv_free_after for s in steps],
            top=[top] * len(steps),
            preempted=[", ".join(s.preempted) for s in steps],
            hits=[s.prefix_hit_tokens for s in steps],
        )
        pre = [s for s in steps if s.preempted]
        self.preempt_source.data = dict(
            step=[s.step for s in pre],
            y=[top] * len(pre),
            label=[f"step {s.step}: preempted {', '.join(s.preempted)}" for s in pre],
        )
        hit = [s for s in steps if s.prefix_hit_tokens]
        self.hit_source.data = dict(
            step=[s.step for s in hit],
            y=[budget * 1.16] * len(hit),
            label=[
                f"step {s.step}: {s.prefix_hit_tokens} tokens from the prefix cache" for s in hit
            ],
        )
        self.budget_line.location = budget
        self.steps_fig.y_range.end = budget * 1.25
        max_free = max([s.kv_free_before for s in steps] + [1])
        self.steps_fig.extra_y_ranges["blocks"].end = max_free * 1.1
        by_group = pd.DataFrame(
            {
                "step": [s.step for s in steps],
                "kv_blocks_by_group": [s.kv_blocks_by_group for s in steps],
                "kv_group_windows": [s.kv_group_windows for s in steps],
            }
        )
        self.groups_source.data = kv_group_series(by_group)
        self.groups_box.visible = bool(self.groups_source.data["xs"])
        table = pd.DataFrame(
            {
                "step": [s.step for s in steps],
                "arrived": [", ".join(s.arrived) for s in steps],
                "decode": [s.decode_tokens for s in steps],
                "prefill": [s.prefill_tokens for s in steps],
                "p0": [s.scheduled.get("p0", 0) for s in steps],
                "p1": [s.scheduled.get("p1", 0) for s in steps],
                "decodes → new block": [s.decodes_new_block for s in steps],
                "free before": [s.kv_free_before for s in steps],
                "free after": [s.kv_free_after for s in steps],
                "prefix-hit tokens": [s.prefix_hit_tokens for s in steps],
                "preempted": [", ".join(s.preempted) for s in steps],
                "finished": [", ".join(s.finished) for s in steps],
            }
        )
        if self.groups_box.visible:
            table["blocks per group"] = [" · ".join(map(str, s.kv_blocks_by_group)) for s in steps]
        self.steps_table.value = table
        self.story.object = _story(steps)


def _story(steps: list[SimStep]) -> str:
    """What happened to p0 and p1, in sentences."""
    lines = []
    for rid in ("p0", "p1"):
        chunks = [(s.step, s.scheduled[rid]) for s in steps if s.scheduled.get(rid, 0) > 1]
        if chunks:
            parts = ", ".join(f"{t} (step {k})" for k, t in chunks)
            lines.append(f"<b>{rid}</b> prefill chunks: {parts}")
    crossings = [s.step for s in steps if s.decodes_new_block]
    if crossings:
        total = sum(s.decodes_new_block for s in steps)
        lines.append(
            f"decodes crossed into a new block {total} times (steps "
            f"{', '.join(map(str, crossings[:12]))}{' …' if len(crossings) > 12 else ''})"
        )
    for s in steps:
        if s.prefix_hit_tokens:
            lines.append(
                f"step {s.step}: {s.prefix_hit_tokens} prompt tokens found in the prefix "
                "cache (not recomputed)"
            )
        if s.preempted:
            lines.append(
                f"step {s.step}: no free block for a running request: preempted "
                f"<b>{', '.join(s.preempted)}</b> (blocks freed, back to waiting, "
                "recomputed later)"
            )
        if s.finished:
            lines.append(f"step {s.step}: finished {', '.join(s.finished)}")
    lines.extend(_groups_story(steps))
    if not lines:
        return ""
    return '<div class="ss-formula">' + "<br>".join(lines) + "</div>"


def _groups_story(steps: list[SimStep]) -> list[str]:
    """With several KV cache groups: how far each group grew over the run (groups that held the
    same blocks at every step, as a window's groups do, in one line)."""
    if not steps or len(steps[-1].kv_blocks_by_group) < 2:
        return []
    last = steps[-1]
    labels = kv_group_labels(last.kv_group_windows, len(last.kv_blocks_by_group))
    alike: dict[tuple[int, ...], list[str]] = {}
    for k, label in enumerate(labels):
        alike.setdefault(tuple(s.kv_blocks_by_group[k] for s in steps), []).append(label)
    return [
        f"{html.escape(' = '.join(names))}: {held[0]} blocks at step 0, at most {max(held)}, "
        f"{held[-1]} at the end"
        for held, names in alike.items()
    ]
