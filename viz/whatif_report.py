"""What `stepscope trace whatif` prints: the self-check line first (on stderr with `--json`),
the cost model's coefficients and fit error (and the steps it left out for contention, also
on stderr with `--json`), one line per setting of the grid, the best setting under the SLOs and
what the prediction cannot see (viz/whatif.py predicts; this only words it).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TextIO

from stepscope.traces.backend.compare import METRICS, aligned, metric_text
from stepscope.traces.backend.explain import CONTENTION_CORES, CONTENTION_SHARE
from stepscope.traces.backend.source import open_trace
from stepscope.traces.backend.units import format_seconds
from stepscope.traces.backend.workload import check_one_run
from stepscope.viz.cost_model import GAP_MATTERS, CostModel
from stepscope.viz.whatif import WhatIf, parse_grid, parse_slo, settings_text, whatif

CANNOT_PREDICT = (
    "It cannot predict a setting that changes what a step costs (the model, dtype, "
    "quantization, tensor or data parallel size, async scheduling): that needs a trace taken "
    "under it. It forces every request's recorded output length and keeps the recorded "
    "arrivals and API-side times, so it cannot see outputs that would end elsewhere or clients "
    "that would send later; and each step costs what the fitted model says: steps whose worker got "
    "too little CPU are left out of the fit, and a machine busier or quieter than the one the "
    "fitted steps ran on is not foreseen."
)


_CHECKED = ("ttft_p50_s", "ttft_p90_s", "tpot_mean_s", "e2e_p50_s", "e2e_p90_s", "throughput_tok_s")


def self_check_line(result: WhatIf) -> str:
    """The recorded settings' prediction against the recorded run, one number at a time."""
    parts = []
    for key in _CHECKED:
        predicted, recorded = result.self_check[key], result.recorded[key]
        off = ""
        if predicted is not None and recorded:
            off = f" ({(predicted - recorded) / recorded:+.0%})"
        label = "throughput" if key == "throughput_tok_s" else key.removesuffix("_s")
        parts.append(f"{label} {metric_text(key, predicted)} vs {metric_text(key, recorded)}{off}")
    return "self-check, the recorded settings predicted vs recorded: " + ", ".join(parts)


def contention_lines(model: CostModel) -> list[str]:
    """What the fit did with steps whose worker got too little CPU (none: no such step)."""
    if not model.contended_steps:
        return []
    steps = f"{model.contended_steps} of {model.num_steps + model.steps_left_out} steps"
    rule = (
        f"under {CONTENTION_SHARE:.0%} of the CPU its threads could have used and under "
        f"{CONTENTION_CORES:g} of a core"
    )
    got = (
        f"{model.contended_cpu_share:.0%} of its threads' CPU, {model.contended_cpu_cores:.2f} "
        f"of a core, measured; {format_seconds(model.contended_mean_step_s)} a step on average"
    )
    if model.busy_machine:
        return [
            f"the trace was taken on a busy machine: in {steps} the worker got {rule} ({got}), "
            "so the fit runs on all of them and every prediction inherits that machine's "
            "slowness; record on a quiet machine for predictions that hold there"
        ]
    return [
        f"{steps} left out of the fit: their worker got {rule} ({got}), so they measure the "
        "busy machine, not the step; the recorded run's own times include them, so the "
        "self-check is off by their extra time"
    ]


def model_lines(model: CostModel) -> list[str]:
    """The cost model's coefficients and fit error, as sentences; then what the fit did with
    contended steps."""
    gap = (
        f"then {format_seconds(model.gap_s)} between steps"
        if model.gap_s
        else f"the {format_seconds(model.recorded_gap_s)} between steps left out (under "
        f"{GAP_MATTERS:.0%} of a step)"
    )
    share = model.mean_abs_error_s / model.mean_step_s if model.mean_step_s else 0.0
    return [
        f"cost model, fitted on {model.num_steps} steps: a step takes {model.terms_text()}; {gap}; "
        f"an idle engine starts a step {format_seconds(model.wake_s)} after a request reaches it",
        f"fit error: {format_seconds(model.mean_abs_error_s)} per step on average ({share:.0%} "
        f"of the mean step of {format_seconds(model.mean_step_s)}), root mean square "
        f"{format_seconds(model.rms_error_s)}",
        *contention_lines(model),
    ]


def _queue_text(reasons: dict[str, float]) -> str:
    if not reasons:
        return "0 s"
    top = max(reasons, key=reasons.__getitem__)
    return f"{format_seconds(sum(reasons.values()))} ({top})"


def grid_table(result: WhatIf) -> str:
    """One line per setting: its values, the predicted numbers, the best marked."""
    keys = list(result.rows[0]["settings"]) if result.rows else []
    header = [*keys, *(k.removesuffix("_s") for k in METRICS[:6]), "throughput", "preempt",
              "queue (most)", ""]  # fmt: skip
    rows = []
    for i, row in enumerate(result.rows):
        texts = [str(row["settings"][k]) for k in keys[1:]]
        texts += [metric_text(k, row[k]) for k in METRICS[:8]]
        texts += [_queue_text(row["queue_s_by_reason"]), "<- best" if i == result.best else ""]
        rows.append((str(row["settings"][keys[0]]), texts))
    return aligned(header, rows)


def report(result: WhatIf) -> list[str]:
    """What `stepscope trace whatif` prints after its self-check line."""
    lines = [*model_lines(result.model), "", grid_table(result), ""]
    if result.slos:
        wanted = " and ".join(f"{k} <= {format_seconds(v)}" for k, v in result.slos.items())
        if result.best is None:
            lines.append(f"no setting meets {wanted}")
        else:
            best = result.rows[result.best]["settings"]
            lines.append(f"best under {wanted}: {settings_text(best)} (the highest throughput)")
    elif result.best is not None:
        best = result.rows[result.best]["settings"]
        lines.append(f"highest throughput: {settings_text(best)} (no --slo given)")
    lines += [f"note: {note}" for note in result.notes]
    lines.append(CANNOT_PREDICT)
    return lines


def trace_whatif(
    path: str,
    grid_specs: Sequence[str],
    slo_specs: Sequence[str] = (),
    as_json: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """`stepscope trace whatif TRACE --grid KEY=V1,V2 ... [--slo KEY=SECONDS] [--json]`: the
    self-check line first (on `err` with `as_json`), then the table of every setting; with
    `as_json` stdout is only the list of settings' objects."""
    out, err = out or sys.stdout, err or sys.stderr
    grid, slos = parse_grid(grid_specs), parse_slo(slo_specs)
    if not grid:
        raise ValueError("give at least one --grid KEY=V1,V2,...")
    with open_trace(path) as source:
        check_one_run(source, path)  # the error names the file
        result = whatif(source, grid, slos)
    print(self_check_line(result), file=err if as_json else out)
    if as_json:  # stdout is only the list: what the fit left out goes beside the self-check
        for line in contention_lines(result.model):
            print(line, file=err)
        print(json.dumps(result.rows, indent=2), file=out)
        return 0
    print("\n".join(report(result)), file=out)
    return 0
