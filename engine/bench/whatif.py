"""`stepscope bench whatif`: how close `trace whatif`'s predictions come to replaying for real.

Three workloads (engine/bench/whatif_workloads.py) are recorded through `LLM`; each recorded
trace is then changed to four settings (the budget halved and doubled, `max_num_seqs` 8, the KV
pool halved, from its recorded configuration), each predicted by viz/whatif.py from the trace
alone and replayed for real twice by `trace replay` (engine/bench/replay.py), the replays in
alternating order. Per case it prints predicted against replayed p50 and p90 TTFT, mean TPOT and
throughput, each error and whether it is within the target, the spread between the replays, and
whether the settings rank the same by p90 TTFT (engine/bench/whatif_check.py). Then it times a
9-setting what-if grid over the hand-made 1,000-request bursty chat mix.

Offline, not served: `trace replay` of an offline run drives the engine in this process and
adds each request at its recorded offset between steps, as the what-if event loop does; a served
replay starts a server per replay and streams every token over HTTP through an API process that
shares the cores with the forward, noise that is neither the workload nor the setting.

engine/ sits below viz/ (tests/test_layering.py), so the CLI hands viz/whatif.py in (`WhatifApi`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from stepscope.engine.bench.whatif_check import (
    LABELS,
    METRICS,
    RANK_BY,
    MetricCheck,
    Ranking,
    case_table,
    cases_for,
    check_case,
    rank,
    ranking_line,
    settings_text,
    tolerance_text,
)
from stepscope.engine.bench.whatif_workloads import (
    ChatMix,
    Plan,
    bursty_chat,
    bursty_chat_plan,
    long_prompt_plan,
    record,
    small_pool_plan,
    warm_up,
)
from stepscope.traces.backend.bench import cpu_name
from stepscope.traces.backend.compare import metric_text, recorded_table
from stepscope.traces.backend.source import open_trace
from stepscope.traces.backend.units import format_number, format_seconds
from stepscope.traces.backend.workload import load_workload, recorded_pool, synthetic_prompts

WORKLOADS = ("bursty_chat", "long_prompt", "small_pool")
# The timing grid: the hand-made workload's budget and max_num_seqs, halved, as recorded, doubled.
GRID = {"max_num_batched_tokens": [256, 512, 1024], "max_num_seqs": [16, 32, 64]}
_VOCAB = 1 << 15  # synthetic prompt ids for the timing workload, as `trace whatif` takes them


class WhatifApi(Protocol):
    """The public functions of viz/whatif.py that this benchmark calls."""

    def whatif(self, source: Any, grid: dict[str, list[Any]], slos: dict[str, float]) -> Any: ...
    def recorded_flat(self, workload: Any) -> dict[str, Any]: ...
    def resolve(self, flat: dict[str, Any], changes: dict[str, Any], pool_blocks: int) -> Any: ...
    def grid_settings(self, grid: dict[str, list[Any]]) -> list[dict[str, Any]]: ...
    def predict(self, workload: Any, prompts: Any, settings: Any, model: Any) -> list[Any]: ...
    def step_time_ratio(self, model: Any, source: Any) -> float | None: ...


@dataclass(slots=True)
class Case:
    label: str
    changes: dict[str, Any]
    predicted: dict[str, Any]  # the what-if table
    replays: list[dict[str, Any]] = field(default_factory=list)  # each replay's recorded table
    replay_s: list[float] = field(default_factory=list)
    # Each replay's steps' own time over what the cost model gives the same steps: its speed
    # against the recording's (1.0), whatever its schedule.
    step_ratios: list[float | None] = field(default_factory=list)

    @property
    def checks(self) -> list[MetricCheck]:
        return check_case(self.predicted, self.replays)


@dataclass(slots=True)
class WorkloadResult:
    plan: Plan
    trace: str
    record_s: float
    recorded: dict[str, Any]  # the recorded run's table
    self_check: dict[str, Any]  # the recorded settings predicted
    model: Any  # viz.cost_model.CostModel
    cases: list[Case]

    @property
    def ranking(self) -> Ranking:
        return rank({c.label: next(m for m in c.checks if m.key == RANK_BY) for c in self.cases})


# ---- one workload ------------------------------------------------------------------------------
def predict_cases(api: WhatifApi, trace: str) -> tuple[list[Case], Any]:
    """Each case of the recorded trace predicted by `whatif` (a one-setting grid), and the
    answer of the first (its self-check and cost model)."""
    cases, first = [], None
    with open_trace(trace) as source:
        config = load_workload(source).engine_config
        for label, changes in cases_for(config, recorded_pool(source)):
            answer = api.whatif(source, {k: [v] for k, v in changes.items()}, {})
            first = first or answer
            (row,) = answer.rows
            cases.append(Case(label, changes, {k: v for k, v in row.items() if k != "settings"}))
    return cases, first


def replay_cases(
    api: WhatifApi, model: Any, trace: str, cases: list[Case], folder: Path, replays: int
) -> None:
    """Replay every case `replays` times into `folder`, the order of the cases reversed every
    other round (a machine that speeds up or slows down during the run favours none), and add
    each replay's recorded table, and its steps' time against the cost model `model`, to its
    case."""
    from stepscope.engine.bench.replay import replay

    name = Path(trace).stem
    for round_ in range(replays):
        ordered = cases if round_ % 2 == 0 else cases[::-1]
        for case in ordered:
            tag = "-".join(f"{k}{v}" for k, v in case.changes.items())
            output = folder / f"{name}-{tag}-{round_ + 1}.duckdb"
            sets = [f"{k}={v}" for k, v in case.changes.items()]
            result = replay(trace, sets, str(output))
            with open_trace(str(output)) as source:
                case.replays.append(recorded_table(source))
                case.step_ratios.append(api.step_time_ratio(model, source))
            case.replay_s.append(result.duration_s)
            print(
                f"  replay {round_ + 1}/{replays} of {case.label} "
                f"({settings_text(case.changes)}): {format_seconds(result.duration_s)}",
                flush=True,
            )


def run_workload(
    api: WhatifApi, plan: Plan, model: str, folder: Path, replays: int
) -> WorkloadResult:
    trace = str(folder / f"{plan.name}.duckdb")
    print(f"{plan.title}; recorded with {settings_text(plan.engine)}", flush=True)
    record_s = record(plan, model, trace)
    print(f"  recorded in {format_seconds(record_s)}: {trace}", flush=True)
    cases, answer = predict_cases(api, trace)
    replay_cases(api, answer.model, trace, cases, folder, replays)
    return WorkloadResult(plan, trace, record_s, answer.recorded, answer.self_check, answer.model,
                          cases)  # fmt: skip


# ---- the grid's time ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GridTiming:
    requests: int
    settings: int
    seconds: float
    cores: int  # the cores this process may use (whatif forks one worker per core)


def time_grid(api: WhatifApi, num_requests: int, model: Any) -> GridTiming:
    """What `trace whatif --grid` does after reading its trace, timed: synthetic prompts, the
    settings resolved against the recorded configuration, and every distinct one simulated
    (the recorded one for the self-check and the grid's 9), over `bursty_chat(num_requests)`
    with `model` (a cost model fitted on a recorded run)."""
    workload = bursty_chat(num_requests)
    grid = api.grid_settings(GRID)
    start = time.perf_counter()
    prompts = synthetic_prompts(workload, _VOCAB)
    flat = api.recorded_flat(workload)
    pool = int(flat["num_kv_blocks"])
    settings = [api.resolve(flat, {}, pool), *(api.resolve(flat, c, pool) for c in grid)]
    api.predict(workload, prompts, settings, model)
    seconds = time.perf_counter() - start
    return GridTiming(len(workload.requests), len(grid), seconds, len(os.sched_getaffinity(0)))


# ---- what it prints ----------------------------------------------------------------------------
def workload_lines(result: WorkloadResult) -> list[str]:
    m = result.model
    share = m.mean_abs_error_s / m.mean_step_s if m.mean_step_s else 0.0
    self_check = ", ".join(
        f"{LABELS[k]} {metric_text(k, result.self_check[k])} vs "
        f"{metric_text(k, result.recorded[k])}"
        for k in METRICS
    )
    lines = [
        f"== {result.plan.title}",
        f"recorded with {settings_text(result.plan.engine)} in "
        f"{format_seconds(result.record_s)}; {result.recorded['preemptions']} preemptions",
        f"cost model: {m.num_steps} steps, {m.terms_text()}; fit error "
        f"{format_seconds(m.mean_abs_error_s)} a step ({share:.0%} of the mean "
        f"{format_seconds(m.mean_step_s)})",
        f"self-check, recorded settings predicted vs recorded: {self_check}",
        "",
        case_table([(c.label, c.changes, c.checks) for c in result.cases]),
        "",
        ranking_line(result.ranking),
        speed_line(result),
        "",
    ]
    return lines


def speed_line(result: WorkloadResult) -> str:
    """How fast each replay's steps ran against the cost model's (fitted on the recording, so
    the recording's own steps are 1.00): a machine whose speed moved between the recording and
    a replay moves every number of that replay, which no prediction from the recording sees."""
    ratios = [r for c in result.cases for r in c.step_ratios if r is not None]
    if not ratios:
        return "replays' steps against the cost model: none measured"
    per_case = "; ".join(
        f"{c.label} " + ", ".join("-" if r is None else f"{r:.2f}" for r in c.step_ratios)
        for c in result.cases
    )
    mean = sum(ratios) / len(ratios)
    return (
        f"replays' steps against the cost model (own time over the model's for the same steps; "
        f"the recording 1.00): {per_case}; mean {mean:.2f}"
    )


def summary_lines(results: list[WorkloadResult], grid: GridTiming | None) -> list[str]:
    checks = [m for r in results for c in r.cases for m in c.checks]
    within = sum(1 for m in checks if m.within)
    same = sum(1 for r in results if r.ranking.same_order)
    beyond = sum(1 for r in results if r.ranking.same_beyond_spread)
    lines = [
        "== summary",
        f"{within} of {len(checks)} numbers within the target ({tolerance_text()})",
        f"ranking by p90 TTFT: the same order in {same} of {len(results)} workloads; no pair the "
        f"replays tell apart swapped in {beyond} of {len(results)}",
    ]
    if grid is not None:
        lines.append(
            f"what-if grid: {grid.settings} settings over {format_number(grid.requests)} bursty "
            f"chat requests predicted in {format_seconds(grid.seconds)} ({grid.cores} cores "
            "allowed)"
        )
    return lines


def machine_line(model: str) -> str:
    import torch

    from stepscope.engine.bench.offline import cpu_matmul_features

    features = cpu_matmul_features()
    return (
        f"machine: {platform.machine()} {cpu_name()}, {len(os.sched_getaffinity(0))} cores "
        f"allowed{f' ({features})' if features else ''}, torch {torch.__version__}; model {model}"
    )


def result_json(
    results: list[WorkloadResult], grid: GridTiming | None, args: argparse.Namespace
) -> dict[str, Any]:
    return {
        "options": {k: v for k, v in vars(args).items() if not callable(v)},
        "machine": machine_line(args.model),
        "model": args.model,
        "workloads": [
            {
                "name": r.plan.name,
                "title": r.plan.title,
                "recorded_settings": r.plan.engine,
                "record_s": round(r.record_s, 4),
                "recorded": r.recorded,
                "self_check": r.self_check,
                "cost_model": {
                    **r.model.coefficients(),
                    "small_max_tokens": r.model.small_max_tokens,
                    "small_terms": list(r.model.small_terms),
                    "num_steps": r.model.num_steps,
                    "mean_step_s": r.model.mean_step_s,
                    "mean_abs_error_s": r.model.mean_abs_error_s,
                },  # fmt: skip
                "cases": [
                    {
                        "label": c.label,
                        "settings": c.changes,
                        "predicted": c.predicted,
                        "replays": c.replays,
                        "replay_s": [round(s, 4) for s in c.replay_s],
                        "step_time_ratios": [
                            None if r is None else round(r, 4) for r in c.step_ratios
                        ],
                        "numbers": {m.key: m.row() for m in c.checks},
                    }
                    for c in r.cases
                ],
                "ranking": r.ranking.row(),
            }
            for r in results
        ],
        "grid": None
        if grid is None
        else {
            "requests": grid.requests,
            "settings": grid.settings,
            "seconds": round(grid.seconds, 4),
            "cores": grid.cores,
        },  # fmt: skip
    }


# ---- the command -------------------------------------------------------------------------------
def plans(args: argparse.Namespace, vocab_size: int) -> list[Plan]:
    """The workloads `--workloads` names, sized by the arguments."""
    p, o = args.max_prompt, args.max_output
    if p < 1 or o < 1:
        raise ValueError("--max-prompt and --max-output must be at least 1")
    make = {
        "bursty_chat": lambda: bursty_chat_plan(
            ChatMix(args.chats, (min(16, p), p), (min(16, o), o), vocab_size, args.seed)
        ),
        "long_prompt": lambda: long_prompt_plan(
            ChatMix(
                args.short_chats,
                (min(16, p), min(128, p)),
                (min(16, o), min(64, o)),
                vocab_size,
                args.seed,
            ),
            args.long_prompt,
        ),
        "small_pool": lambda: small_pool_plan(
            ChatMix(
                args.pool_chats, (min(32, p), min(160, p)), ((o + 1) // 2, o), vocab_size, args.seed
            )
        ),
    }
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in make]
    if unknown or not names:
        raise ValueError(f"--workloads: choose from {', '.join(WORKLOADS)}, got {args.workloads!r}")
    for flag in ("chats", "short_chats", "pool_chats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.replays < 2:
        raise ValueError("--replays must be at least 2: the spread needs two replays")
    return [make[n]() for n in names]


def bench_whatif(args: argparse.Namespace, api: WhatifApi) -> int:
    from stepscope.engine.models.loader import load_config, resolve_model

    vocab_size = load_config(resolve_model(args.model))["vocab_size"]
    chosen = plans(args, vocab_size)
    if args.traces is not None:
        folder = Path(args.traces)
        folder.mkdir(parents=True, exist_ok=True)
        if any(folder.glob("*.duckdb")):
            raise ValueError(f"--traces {folder} holds traces already: give an empty folder")
        return _run(args, api, chosen, folder)
    with tempfile.TemporaryDirectory(prefix="bench-whatif-") as tmp:
        return _run(args, api, chosen, Path(tmp))


def _run(args: argparse.Namespace, api: WhatifApi, chosen: list[Plan], folder: Path) -> int:
    print(machine_line(args.model), flush=True)
    warm_up(args.model)
    results = [run_workload(api, plan, args.model, folder, args.replays) for plan in chosen]
    grid = None
    if args.grid_requests > 0:
        bursty = next((r for r in results if r.plan.name == "bursty_chat"), results[0])
        grid = time_grid(api, args.grid_requests, bursty.model)
    print()
    for result in results:
        print("\n".join(workload_lines(result)))
    print("\n".join(summary_lines(results, grid)), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result_json(results, grid, args), f, indent=2)
        print(f"wrote {args.out}")
    return 0
