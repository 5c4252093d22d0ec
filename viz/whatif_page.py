"""Dashboard page 4: what if the scheduler's settings were different, on the loaded trace's own
workload (`stepscope trace whatif`, one setting at a time).

Three sliders, the token budget (`max_num_batched_tokens`), `max_num_seqs` and the KV pool
(`num_kv_blocks`), start at the recorded settings. Each setting is predicted by viz/whatif.py:
the engine's real `Scheduler` and `KVCacheManager` over the recorded arrivals, each step timed by
the cost model fitted on the trace's own steps. The page shows the prediction beside the recorded
run and beside the recorded settings' own prediction (the self-check: the gap between those two
is the cost model's error), the fit's coefficients and error, and what it cannot predict.

The trace is read and the model fitted once per trace (`whatif.load_trace`; again only when a
live source's reload button asks); a slider move is one simulation, remembered per setting. In a
served session, moves that arrive while a prediction runs are gathered: the next prediction,
`THROTTLE_MS` after the first of them, takes the sliders' latest values, so slow predictions do
not pile up.
"""

from __future__ import annotations

import html
import logging
import time
from collections import OrderedDict
from typing import Any

import panel as pn
from bokeh.models import ColumnDataSource, FactorRange, HoverTool

from stepscope.traces.backend.compare import METRICS, metric_text, ratios, table_rows
from stepscope.traces.backend.source import TraceSource
from stepscope.viz.ui import CSS, NO_TRACE, bokeh_pane, cards, new_figure, outside_legend
from stepscope.viz.whatif import LoadedTrace, Prediction, load_trace
from stepscope.viz.whatif_report import CANNOT_PREDICT, model_lines

logger = logging.getLogger(__name__)

# key (an EngineConfig field): (label, CSS class the browser tests find the slider by)
KNOBS = {
    "max_num_batched_tokens": ("Token budget (max_num_batched_tokens)", "wi-budget"),
    "max_num_seqs": ("max_num_seqs", "wi-seqs"),
    "num_kv_blocks": ("KV pool (num_kv_blocks)", "wi-pool"),
}
MAX_SLIDER_STEPS = 256  # a slider's step doubles until its range has at most this many
THROTTLE_MS = 150  # slider moves within this of the first one are predicted together
CACHED_PREDICTIONS = 64
SERIES = {  # the three columns of the page's table and its bars
    "recorded": "#7F7F7F",
    "predicted, recorded settings": "#9ECAE9",
    "predicted, these settings": "#F58518",
}
LATENCY_BARS = {"ttft_p50_s": "TTFT p50", "ttft_p90_s": "TTFT p90",
                "e2e_p50_s": "e2e p50", "e2e_p90_s": "e2e p90"}  # fmt: skip
READOUTS = {  # table key: (element id of its predicted value, label)
    "ttft_p50_s": ("ro-wi-ttft-p50", "TTFT p50"),
    "ttft_p90_s": ("ro-wi-ttft-p90", "TTFT p90"),
    "tpot_mean_s": ("ro-wi-tpot", "mean TPOT"),
    "e2e_p50_s": ("ro-wi-e2e-p50", "e2e p50"),
    "throughput_tok_s": ("ro-wi-throughput", "throughput"),
    "preemptions": ("ro-wi-preemptions", "preemptions"),
}


# ---- the sliders' ranges ------------------------------------------------------------------------
def knob_range(recorded: int, low: int, high: int) -> tuple[int, int, int]:
    """(start, end, step) of a slider from about `low` to about `high` with `recorded` on its
    grid: the step is the smallest power of two that leaves at most MAX_SLIDER_STEPS steps."""
    low, high = min(low, recorded), max(high, recorded)
    step = 1
    while (high - low) / step > MAX_SLIDER_STEPS:
        step *= 2
    start = recorded - step * ((recorded - low) // step)
    end = start + step * -(-(high - start) // step)
    return max(start, 1), end, step


def knob_ranges(loaded: LoadedTrace) -> dict[str, tuple[int, int, int, int]]:
    """(start, end, step, recorded value) of each knob over this trace: from the least every
    recorded request can run under (a pool holding the longest request; without chunked
    prefill, a budget holding the longest prompt) to four times the recorded value."""
    settings = loaded.settings({})
    requests = loaded.workload.requests
    explicit = loaded.flat.get("max_model_len") or 0
    longest_prompt = max(r.input_tokens for r in requests)
    longest = max(r.input_tokens + r.output_tokens for r in requests)
    budget = settings.max_num_batched_tokens
    low_budget = (
        min(settings.block_size, budget)
        if settings.enable_chunked_prefill
        else max(longest_prompt, explicit)
    )
    seqs, pool, size = settings.max_num_seqs, settings.num_kv_blocks, settings.block_size
    low_pool = -(-max(longest + 1, explicit) // size)
    return {
        "max_num_batched_tokens": (*knob_range(budget, low_budget, 4 * budget), budget),
        # More sequences than requests changes nothing.
        "max_num_seqs": (*knob_range(seqs, 1, max(seqs, min(2 * seqs, len(requests)))), seqs),
        "num_kv_blocks": (*knob_range(pool, low_pool, 4 * pool), pool),
    }


# ---- the page -----------------------------------------------------------------------------------
class WhatIfPage:
    """The recorded workload under another token budget, max_num_seqs and KV pool, predicted."""

    def __init__(self, source: TraceSource | None) -> None:
        self.source = source
        self.loaded: LoadedTrace | None = None
        self.baseline: Prediction | None = None  # the recorded settings, predicted
        self.prediction: Prediction | None = None  # the sliders' settings, predicted
        self._cache: OrderedDict[tuple[int, ...], Prediction] = OrderedDict()
        self._holding = False  # setting the sliders together: predict once, after
        self._scheduled = False  # a throttled prediction is waiting to run
        self.sliders = {
            key: pn.widgets.IntSlider(
                label=label,
                start=0,
                end=1,
                value=0,
                css_classes=[css],
                sizing_mode="stretch_width",
            )
            for key, (label, css) in KNOBS.items()
        }
        for slider in self.sliders.values():
            slider.param.watch(self._changed, "value")
        self.reset = pn.widgets.Button(label="Back to the recorded settings", variant="outline")
        self.reset.on_click(lambda _: self.set_values(self.recorded_values()))
        live = source is not None and source.live
        self.reload = pn.widgets.Button(label="Read the trace again", visible=live)
        self.reload.on_click(lambda _: self.load())
        self.empty = pn.pane.Markdown(NO_TRACE, visible=source is None)
        self.problem = pn.pane.Alert("", alert_type="warning", visible=False)
        self.error = pn.pane.Alert("", alert_type="danger", visible=False)
        self.status = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.readouts = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.table = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.model_text = pn.pane.HTML(sizing_mode="stretch_width", stylesheets=[CSS])
        self.latency_source = ColumnDataSource(dict(x=[], seconds=[], text=[], series=[], color=[]))
        self.queue_source = ColumnDataSource(dict(y=[], seconds=[], text=[], series=[], color=[]))
        self.latency_fig, self.queue_fig = self._figures()
        self.content = self._layout()
        self.panel = pn.Column(
            self.empty, self.problem, self.reload, self.content, sizing_mode="stretch_width"
        )
        self.load()

    # -- layout --
    def _figures(self) -> tuple[Any, Any]:
        factors = [(label, s) for label in LATENCY_BARS.values() for s in SERIES]
        latency = new_figure("Latency (s): recorded and predicted", height=280,
                             x_range=FactorRange(*factors))  # fmt: skip
        latency.vbar(x="x", top="seconds", width=0.85, source=self.latency_source,
                     color="color", legend_field="series")  # fmt: skip
        latency.xaxis.major_label_text_font_size = "0px"  # the legend names the three bars
        latency.y_range.start = 0
        queue = new_figure("Queue time by reason, summed over requests (s)", height=280,
                           y_range=FactorRange())  # fmt: skip
        queue.hbar(y="y", right="seconds", height=0.85, source=self.queue_source,
                   color="color", legend_field="series")  # fmt: skip
        queue.yaxis.major_label_text_font_size = "0px"
        queue.yaxis.group_label_orientation = "horizontal"  # the reasons, read across
        queue.min_border_left = 150
        queue.x_range.start = 0
        for fig in (latency, queue):
            fig.toolbar_location = None
            fig.add_tools(HoverTool(tooltips=[("", "@series: @text")]))
            outside_legend(fig, "below")
        return latency, queue

    def _layout(self) -> pn.Column:
        intro = pn.pane.Markdown(
            "What would this run have done under another token budget, `max_num_seqs` or KV "
            "pool? The engine's real `Scheduler` and `KVCacheManager` run over the recorded "
            "arrivals, each request's recorded lengths and prefix, and each step is timed by a "
            "cost model fitted on this trace's own steps (`stepscope trace whatif`, "
            "docs/tracing.md). The middle column predicts the recorded settings: its distance "
            "from the recorded run is the model's error, so compare the last column with it.",
            sizing_mode="stretch_width",
        )
        controls = pn.Column(
            *self.sliders.values(),
            self.reset,
            self.error,
            self.status,
            width=420,
        )
        charts = pn.Row(bokeh_pane(self.latency_fig), bokeh_pane(self.queue_fig),
                        sizing_mode="stretch_width")  # fmt: skip
        return pn.Column(
            intro,
            pn.Row(
                controls,
                pn.Column(self.readouts, self.table, sizing_mode="stretch_width"),
                sizing_mode="stretch_width",
            ),
            charts,
            self.model_text,
            sizing_mode="stretch_width",
            visible=False,
        )

    # -- loading (once per trace) --
    def load(self) -> None:
        """Read the trace, fit the cost model, set the sliders to the recorded settings; a trace
        that cannot be predicted shows why instead."""
        self._cache.clear()
        self.loaded = self.baseline = self.prediction = None
        if self.source is None:
            return
        try:
            loaded = load_trace(self.source)
            baseline = loaded.predict({})
            ranges = knob_ranges(loaded)
        except Exception as error:  # a trace this page cannot use must not break the dashboard
            if not isinstance(error, ValueError):
                logger.exception("what-if: reading the trace failed")
            self.problem.object = (
                f"**This trace cannot be predicted.** {error}"
                if isinstance(error, ValueError)
                else f"**Reading this trace for a prediction failed:** {type(error).__name__}: "
                f"{error}"
            )
            if self.source.live:
                self.problem.object += (
                    " This source is live: if a run is still on its way, read the trace again "
                    "once it has sent its requests and steps."
                )
            self.problem.visible, self.content.visible = True, False
            return
        self.loaded, self.baseline = loaded, baseline
        self._holding = True
        try:
            for key, (start, end, step, value) in ranges.items():
                self.sliders[key].param.update(start=start, end=end, step=step, value=value)
        finally:
            self._holding = False
        self.model_text.object = self._model_html(loaded)
        self.problem.visible, self.content.visible = False, True
        self.update()

    def recorded_values(self) -> dict[str, int]:
        if self.loaded is None:
            return {}
        settings = self.loaded.settings({})
        return {key: int(getattr(settings, key)) for key in KNOBS}

    def values(self) -> dict[str, int]:
        return {key: int(slider.value) for key, slider in self.sliders.items()}

    def set_values(self, values: dict[str, int]) -> None:
        """Move several sliders, then predict once."""
        self._holding = True
        try:
            for key, value in values.items():
                self.sliders[key].value = value
        finally:
            self._holding = False
        self.update()

    # -- predicting (once per setting) --
    def _changed(self, *_: Any) -> None:
        if self._holding or self.loaded is None:
            return
        doc = pn.state.curdoc
        if doc is None or doc.session_context is None:  # no browser: nothing to gather
            self.update()
        elif not self._scheduled:
            self._scheduled = True
            pn.state.add_periodic_callback(self._throttled, period=THROTTLE_MS, count=1)

    def _throttled(self) -> None:
        self._scheduled = False
        self.update()

    def predict(self, values: dict[str, int]) -> Prediction:
        """One setting's prediction, remembered (the last CACHED_PREDICTIONS settings)."""
        assert self.loaded is not None
        key = tuple(values[k] for k in KNOBS)
        if key not in self._cache:
            self._cache[key] = self.loaded.predict(values)
            while len(self._cache) > CACHED_PREDICTIONS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]

    def update(self) -> None:
        """Predict the sliders' setting and show it beside the recorded run."""
        if self.loaded is None or self.baseline is None:
            return
        values = self.values()
        remembered = tuple(values[k] for k in KNOBS) in self._cache
        began = time.perf_counter()
        try:
            self.prediction = self.predict(values)
        except (ValueError, RuntimeError) as error:  # a setting the engine would refuse
            self.prediction = None
            self.error.object = str(error)
            self.error.visible = True
        else:
            self.error.visible = False
        took = None if remembered else time.perf_counter() - began
        self._show(values, took)

    # -- showing --
    def _show(self, values: dict[str, int], took_s: float | None) -> None:
        assert self.loaded is not None and self.baseline is not None
        recorded, baseline = self.loaded.recorded, self.baseline.table
        predicted = None if self.prediction is None else self.prediction.table
        self.readouts.object = cards(
            [
                (
                    element.removeprefix("ro-"),
                    f"{label} (predicted)",
                    "-" if predicted is None else metric_text(key, predicted[key]),
                )
                for key, (element, label) in READOUTS.items()
            ]  # fmt: skip
        )
        self.table.object = comparison_html(recorded, baseline, predicted)
        self.status.object = _status_html(values, self.recorded_values(), self.prediction, took_s)
        tables = {"recorded": recorded, "predicted, recorded settings": baseline,
                  "predicted, these settings": predicted}  # fmt: skip
        self.latency_source.data = _bars(
            "x", [(label, key) for key, label in LATENCY_BARS.items()], tables
        )
        reasons = sorted({r for t in tables.values() if t for r in t["queue_s_by_reason"]})
        # Factors run bottom-up: reversed, the reasons read top-down in order.
        self.queue_fig.y_range.factors = [
            (r, s) for r in reversed(reasons) for s in reversed(SERIES)
        ]
        self.queue_source.data = _bars("y", [(r, ("queue_s_by_reason", r)) for r in reasons],
                                       tables)  # fmt: skip

    @staticmethod
    def _model_html(loaded: LoadedTrace) -> str:
        lines = [*model_lines(loaded.model), *(f"note: {n}" for n in loaded.notes)]
        sentences = "<br>".join(html.escape(line) for line in lines)
        return (
            f'<div class="ss-formula">{sentences}</div>'
            f"<p><b>What it cannot predict.</b> {html.escape(CANNOT_PREDICT)}</p>"
        )


def _bars(
    axis: str, items: list[tuple[str, Any]], tables: dict[str, dict[str, Any] | None]
) -> dict[str, list[Any]]:
    """One bar per (item, series): `items` are (label, key), a key a table key or
    ("queue_s_by_reason", reason); a series without a table (a refused setting) has none."""
    data: dict[str, list[Any]] = {axis: [], "seconds": [], "text": [], "series": [], "color": []}
    for label, key in items:
        for series, table in tables.items():
            if table is None:
                continue
            value = table[key] if isinstance(key, str) else table[key[0]].get(key[1], 0.0)
            data[axis].append((label, series))
            data["seconds"].append(value or 0.0)
            data["text"].append(metric_text("_s", value))
            data["series"].append(series)
            data["color"].append(SERIES[series])
    return data


def comparison_html(
    recorded: dict[str, Any], baseline: dict[str, Any], predicted: dict[str, Any] | None
) -> str:
    """The recorded run, the recorded settings' prediction and these settings' prediction side
    by side, with these settings over the recorded ones (both predicted); a refused setting's
    column is empty."""
    empty = {**dict.fromkeys(METRICS[:-1]), "queue_s_by_reason": {}}
    rows = table_rows([recorded, baseline, predicted or empty])  # queue reasons last, sorted
    ratio = None if predicted is None else ratios(baseline, predicted)
    reasons = sorted({*recorded["queue_s_by_reason"], *baseline["queue_s_by_reason"],
                      *(predicted or empty)["queue_s_by_reason"]})  # fmt: skip
    changes = [None if ratio is None else ratio[k] for k in METRICS[:-1]]
    changes += [None if ratio is None else ratio["queue_s_by_reason"].get(r) for r in reasons]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ("", *SERIES, "these / recorded settings"))
    body = "".join(
        f"<tr><td>{html.escape(label)}</td>"
        + "".join(f'<td class="num">{html.escape(t)}</td>' for t in texts)
        + f'<td class="num">{"-" if c is None else f"× {c:.3g}"}</td></tr>'
        for (label, texts), c in zip(rows, changes, strict=True)
    )
    return f'<table class="ss-table" id="wi-table"><tr>{head}</tr>{body}</table>'


def _status_html(
    values: dict[str, int],
    recorded: dict[str, int],
    prediction: Prediction | None,
    took_s: float | None,
) -> str:
    """Which setting the numbers are for, and how long its simulation took (None: predicted
    before, remembered)."""
    changed = [
        f"{k} {values[k]} (recorded {recorded[k]})" for k in KNOBS if values[k] != recorded[k]
    ]
    what = "; ".join(changed) if changed else "the recorded settings"
    if prediction is None:
        done = "refused (see above)"
    elif took_s is None:
        done = f"{prediction.num_steps} steps (predicted before)"
    else:
        done = f"{prediction.num_steps} steps simulated in {metric_text('_s', took_s)}"
    return (
        f'<div class="ss-formula" id="wi-status">Predicting {html.escape(what)}: '
        f"{html.escape(done)}</div>"
    )
