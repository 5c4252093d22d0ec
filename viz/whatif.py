"""What if: a recorded run's workload under other scheduler settings, predicted without the model.

The engine's real `Scheduler` and `KVCacheManager` (stages 3 and 4) run over the recorded
arrivals in an event loop, and a cost model fitted on the trace's own steps says how long each
step takes:

- **The cost model** (viz/cost_model.py): each recorded step's own compute time fitted as
  `fixed + prefill tokens x a + decode tokens x b + context tokens x c`, coefficients kept
  non-negative, plus the mean gap between steps where it matters; a run on GGUF blocks has its
  steps on the quantized kernels (a few tokens) fitted apart from the rest.
- **The event loop.** Each request enters the scheduler once the clock passes its recorded
  arrival at the engine core (`arrival_s + before_engine_s`), its prompt from
  `workload.synthetic_prompts` (so prefix hits happen as recorded), its recorded output length
  forced (`max_tokens`, `ignore_eos`; what is sampled does not matter). Each `schedule()` +
  `update_from_output()` advances the clock by the model's time for the step it scheduled; the
  loop records each request's scheduled, first-token and finished times, each step's
  `waiting_reason` and the preemptions. TTFT and end-to-end time add the request's recorded time
  on the API side (`before_engine_s`, `after_engine_s`), and queue time is split by reason with
  explain's rule, so that `compare.run_table` makes the same table as for a recorded run.

Only settings the scheduler and the KV cache manager read can change (`GRID_KEYS`); one that
changes what a step costs is refused with a sentence saying a trace taken under it is needed.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from stepscope.engine.config import (
    PARTS,
    EngineConfig,
    check_no_chunk_budget,
    field_parts,
    unknown_name_message,
)
from stepscope.engine.core.kv_cache_manager import KVCacheManager
from stepscope.engine.core.request import Request
from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.messages import ModelRunnerOutput
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces.backend.compare import (
    RequestTimes,
    StepColumns,
    queue_split,
    recorded_table,
    run_table,
)
from stepscope.traces.backend.source import Queryable
from stepscope.traces.backend.workload import (
    Workload,
    load_workload,
    recorded_pool,
    synthetic_prompts,
)
from stepscope.viz.cost_model import (  # noqa: F401  (step_time_ratio: for bench whatif)
    CostModel,
    fit_cost_model,
    small_step_tokens,
    step_time_ratio,
)

# The settings whatif can change: what the scheduler and the KV cache manager read.
GRID_KEYS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "num_kv_blocks",
    "block_size",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "max_model_len",
)
# Settings that change what a step costs (or how steps overlap): the cost model was fitted on
# steps taken without them.
STEP_COST_KEYS = (
    "model",
    "device",
    "dtype",
    "quantization",
    "quantized_max_tokens",
    "fused_decode",
    "attention_backend",
    "tensor_parallel_size",
    "data_parallel_size",
    "data_parallel_size_local",
    "executor",
    "nnodes",
    "async_scheduling",
)
SLO_KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_mean", "e2e_p50", "e2e_p90")
# Simulations run in worker processes when they decode at least this many tokens in all (about
# two seconds of work on one core: more than starting the workers costs).
PARALLEL_TOKENS = 300_000
_CAN_FORK = "fork" in multiprocessing.get_all_start_methods()
_TOKEN = 1  # what every simulated step samples: the tokens do not matter, their number does
_VOCAB = 1 << 15  # synthetic prompt ids: any range works, equal blocks only need equal ids


# ---- settings ----------------------------------------------------------------------------------
def refusal(key: str) -> str | None:
    """Why `key` cannot be a what-if setting (None: it can)."""
    if key in GRID_KEYS:
        return None
    known = field_parts(internal=True)
    if key not in known:
        return unknown_name_message(key, [*GRID_KEYS, *known])
    if key in STEP_COST_KEYS:
        return (
            f"{key} changes what a step costs, and the cost model knows only the steps of this "
            f"trace: a trace taken under the {key} you want is needed (record one, or replay "
            "this one with it)"
        )
    if key == "kv_cache_memory_fraction":
        return (
            "kv_cache_memory_fraction sizes the KV pool from the free memory of the machine "
            "that runs it: give the pool in blocks with num_kv_blocks instead"
        )
    return f"{key} changes neither what the scheduler decides nor what a step costs"


def _parse_value(key: str, text: str) -> Any:
    part = field_parts(internal=True)[key]
    default = getattr(PARTS[part](), key)
    text = text.strip()
    if isinstance(default, bool):
        lowered = text.lower()
        if lowered in ("true", "on", "yes", "1"):
            return True
        if lowered in ("false", "off", "no", "0"):
            return False
        raise ValueError(f"{key} takes true or false, got {text!r}")
    if key == "max_model_len" and text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key} takes whole numbers, got {text!r}") from None


def parse_grid(specs: Sequence[str]) -> dict[str, list[Any]]:
    """`["max_num_seqs=8,16", ...]` -> {"max_num_seqs": [8, 16], ...}; a key whatif cannot
    change, or a malformed value, raises ValueError saying why."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not values.strip():
            raise ValueError(f"--grid takes KEY=V1,V2,..., got {spec!r}")
        why = refusal(key)
        if why is not None:
            raise ValueError(why)
        if key in grid:
            raise ValueError(f"--grid names {key} twice")
        grid[key] = [_parse_value(key, v) for v in values.split(",")]
    return grid


def parse_slo(specs: Sequence[str]) -> dict[str, float]:
    """`["ttft_p90=2.5"]` -> {"ttft_p90": 2.5} (seconds; every one must hold)."""
    slos: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        key = key.strip().removesuffix("_s")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo takes one of {', '.join(SLO_KEYS)}=SECONDS, got {spec!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo {key} takes seconds, got {value!r}") from None
    return slos


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """What the scheduler and KV cache manager of one simulated engine are built with."""

    max_num_batched_tokens: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    max_model_len: int


def recorded_flat(workload: Workload) -> dict[str, Any]:
    """The recorded EngineConfig by flat field names (as `EngineConfig.create` takes them)."""
    config = workload.engine_config
    flat: dict[str, Any] = {"offline": config.get("offline", True)}
    for part in PARTS:
        flat.update(config.get(part, {}))
    return flat


def resolve(flat: dict[str, Any], changes: dict[str, Any], pool_blocks: int) -> SchedulerSettings:
    """The recorded settings with `changes` applied, validated as the engine would (a pool too
    small for the context asked, a budget below the context without chunked prefill).
    `pool_blocks`: the recorded pool, where the recorded config left it to the memory fraction."""
    values = {**flat, **changes}
    try:  # the device is not asked about: nothing runs
        config = EngineConfig.create(**{**values, "device": "cpu"})
    except ValueError as error:
        raise ValueError(f"{settings_text(changes)}: {error}") from None
    cache, sched = config.cache_config, config.scheduler_config
    blocks = cache.num_kv_blocks if cache.num_kv_blocks is not None else pool_blocks
    if cache.num_kv_blocks is None and cache.block_size != int(flat["block_size"]):
        # A pool sized from free memory: the same memory holds fewer blocks of more tokens.
        blocks = max(1, blocks * int(flat["block_size"]) // cache.block_size)
    capacity = blocks * cache.block_size
    explicit = config.model_config.max_model_len
    if explicit is not None and explicit > capacity:
        raise ValueError(
            f"{settings_text(changes)}: max_model_len {explicit} does not fit in the KV cache "
            f"of {blocks} blocks of {cache.block_size} tokens ({capacity} tokens)"
        )
    if explicit is not None:  # without one, the model's own limit applies, unknown here
        try:
            check_no_chunk_budget(sched, explicit)
        except ValueError as error:
            raise ValueError(f"{settings_text(changes)}: {error}") from None
    # The longest a request can grow: the context asked for, else what the pool holds (the
    # engine lowers the model's limit to it; a recorded request was within the model's).
    max_model_len = explicit if explicit is not None else capacity
    return SchedulerSettings(
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        max_num_seqs=int(sched.max_num_seqs),
        num_kv_blocks=blocks,
        block_size=cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        enable_chunked_prefill=sched.enable_chunked_prefill,
        max_model_len=max_model_len,
    )


def settings_text(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "the recorded settings"


# ---- the event loop ----------------------------------------------------------------------------
@dataclass(slots=True)
class Prediction:
    """One setting's predicted run: each request's times and the table `compare` makes."""

    requests: list[RequestTimes]
    table: dict[str, Any]
    num_steps: int
    prefill_tokens: int  # prompt (and recomputed) tokens the steps ran, prefix hits not


@dataclass(slots=True)
class _Times:
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    preemptions: int = 0
    tokens: int = 0


def _engine(settings: SchedulerSettings) -> Scheduler:
    kv = KVCacheManager(settings.num_kv_blocks, settings.block_size, settings.enable_prefix_caching)
    return Scheduler(
        kv,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        enable_chunked_prefill=settings.enable_chunked_prefill,
    )


def _run_rank(
    arrivals: list[tuple[float, Request]], settings: SchedulerSettings, model: CostModel
) -> tuple[dict[str, _Times], StepColumns, int]:
    """One engine core's scheduler over its requests (engine arrival, request), in time order.
    Returns each request's times, the steps (start_ns, waiting_reason) and the prefill tokens
    they ran."""
    scheduler = _engine(settings)
    pending = deque(arrivals)
    times = {request.request_id: _Times() for _, request in arrivals}
    starts: list[int] = []
    reasons: list[str | None] = []
    clock = 0.0
    prefill = 0
    while pending or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock = max(clock, pending[0][0] + model.wake_s)
        while pending and pending[0][0] <= clock:
            scheduler.add_request(pending.popleft()[1])
        output = scheduler.schedule()
        if not output.num_scheduled_tokens and not output.preempted_req_ids:
            if not pending:
                raise RuntimeError(
                    f"the scheduler can run none of its {scheduler.num_unfinished} requests"
                )
            clock = max(clock, pending[0][0])
            continue
        stats = scheduler.last_stats
        prefill += stats.num_prefill_tokens
        end = clock + model.step_s(
            stats.num_prefill_tokens, stats.num_decode_tokens, stats.num_context_tokens
        )
        starts.append(round(clock * 1e9))
        reasons.append(stats.waiting_reason)
        for new in output.scheduled_new_reqs:
            entry = times[new.req_id]
            if entry.scheduled is None:
                entry.scheduled = clock
        sampled = [
            [_TOKEN]
            if (r := scheduler.requests[req_id]).num_computed_tokens >= r.num_tokens
            else []
            for req_id in output.num_scheduled_tokens
        ]
        runner = ModelRunnerOutput(
            req_ids=list(output.num_scheduled_tokens), sampled_token_ids=sampled
        )
        for out in scheduler.update_from_output(output, runner):
            entry = times[out.request_id]
            entry.tokens += len(out.new_token_ids)
            if entry.first_token is None:
                entry.first_token = end
            if out.finish_reason is not None:
                entry.finished = end
                entry.preemptions = out.num_preemptions
        clock = end + model.gap_s
    return times, StepColumns(starts, reasons), prefill


def _check_fits(request_id: str, prompt_len: int, settings: SchedulerSettings) -> None:
    """A prompt the engine would refuse, or could never schedule, under `settings`."""
    if prompt_len >= settings.max_model_len:
        raise ValueError(
            f"request {request_id}'s prompt of {prompt_len} tokens does not fit the context of "
            f"{settings.max_model_len} tokens ({settings.num_kv_blocks} KV blocks of "
            f"{settings.block_size}): the engine would refuse it"
        )
    if not settings.enable_chunked_prefill and prompt_len > settings.max_num_batched_tokens:
        raise ValueError(
            "without chunked prefill every prompt must fit in one step: request "
            f"{request_id}'s prompt has {prompt_len} tokens, max_num_batched_tokens is "
            f"{settings.max_num_batched_tokens} (and the engine refuses a budget below the "
            "model's context)"
        )


def simulate(
    workload: Workload,
    prompts: Sequence[Sequence[int]],
    settings: SchedulerSettings,
    model: CostModel,
) -> Prediction:
    """The workload's requests through one scheduler per recorded DP rank (each request on the
    rank it was routed to), timed by `model`."""
    by_rank: dict[int, list[tuple[float, Request]]] = {}
    for req, prompt in zip(workload.requests, prompts, strict=True):
        _check_fits(req.request_id, len(prompt), settings)
        params = SamplingParams(
            max_tokens=max(req.output_tokens, 1),
            ignore_eos=True,
            temperature=0.0,
            prompt_logprobs=req.sampling.get("prompt_logprobs"),
        )
        request = Request(req.request_id, list(prompt), params, None, settings.block_size)
        by_rank.setdefault(req.dp_rank, []).append((req.arrival_s + req.before_engine_s, request))
    results: list[RequestTimes] = []
    num_steps = prefill = 0
    recorded = {r.request_id: r for r in workload.requests}
    for arrivals in by_rank.values():
        arrivals.sort(key=lambda a: a[0])
        times, steps, rank_prefill = _run_rank(arrivals, settings, model)
        num_steps += len(steps)
        prefill += rank_prefill
        for queued_s, request in arrivals:
            results.append(_request_times(recorded[request.request_id], queued_s,
                                          times[request.request_id], steps))  # fmt: skip
    return Prediction(results, run_table(results), num_steps, prefill)


def _request_times(req: Any, queued_s: float, t: _Times, steps: StepColumns) -> RequestTimes:
    queued, scheduled = round(queued_s * 1e9), round((t.scheduled or queued_s) * 1e9)
    finished = t.finished if t.finished is not None else queued_s
    return RequestTimes(
        request_id=req.request_id,
        start_ns=round(req.arrival_s * 1e9),
        first_token_ns=None if t.first_token is None else round(t.first_token * 1e9),
        finished_ns=round(finished * 1e9),
        end_ns=round((finished + req.after_engine_s) * 1e9),
        output_tokens=t.tokens,
        preemptions=t.preemptions,
        queue_s_by_reason=queue_split(steps, queued, scheduled),
    )


# ---- the grid ----------------------------------------------------------------------------------
_shared: tuple[Workload, Sequence[Sequence[int]], CostModel] | None = None


def _hold(workload: Workload, prompts: Sequence[Sequence[int]], model: CostModel) -> None:
    global _shared
    _shared = (workload, prompts, model)


def _simulate_held(settings: SchedulerSettings) -> Prediction:
    assert _shared is not None, "_hold runs first in every worker"
    return simulate(*_shared[:2], settings, _shared[2])


def predict(
    workload: Workload,
    prompts: Sequence[Sequence[int]],
    settings: Sequence[SchedulerSettings],
    model: CostModel,
) -> list[Prediction]:
    """One prediction per setting (each distinct one simulated once), the simulations spread
    over this machine's cores (forked workers) where there is enough work to pay for them."""
    unique = list(dict.fromkeys(settings))
    workers = min(len(unique), len(os.sched_getaffinity(0)))
    tokens = sum(r.output_tokens for r in workload.requests) * len(unique)
    if workers < 2 or tokens < PARALLEL_TOKENS or not _CAN_FORK:
        done = {s: simulate(workload, prompts, s, model) for s in unique}
    else:
        # Forked, the workers start at once with the workload in hand; they run only the
        # scheduler (pure Python), none of the threads this process may hold (DuckDB's).
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(
            workers, mp_context=context, initializer=_hold, initargs=(workload, prompts, model)
        ) as pool:
            done = dict(zip(unique, pool.map(_simulate_held, unique), strict=True))
    return [done[s] for s in settings]


def grid_settings(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every setting of the cartesian grid, as {key: value} in the grid's key order."""
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


@dataclass(slots=True)
class WhatIf:
    """A grid's answer: one row per setting (`settings` plus the table's keys), the recorded
    run's table and the recorded settings' prediction (the self-check), the cost model, and the
    best setting under the SLOs (None: no setting meets them)."""

    rows: list[dict[str, Any]]
    recorded: dict[str, Any]
    self_check: dict[str, Any]
    model: CostModel
    slos: dict[str, float]
    best: int | None
    notes: list[str]


def meets(row: dict[str, Any], slos: dict[str, float]) -> bool:
    return all(
        row[f"{key}_s"] is not None and row[f"{key}_s"] <= bound for key, bound in slos.items()
    )


def best_row(rows: Sequence[dict[str, Any]], slos: dict[str, float]) -> int | None:
    """The highest throughput among the rows that meet every SLO (ties: the lower p90 TTFT)."""
    ok = [i for i, row in enumerate(rows) if meets(row, slos) and row["throughput_tok_s"]]
    if not ok:
        return None
    return max(ok, key=lambda i: (rows[i]["throughput_tok_s"], -(rows[i]["ttft_p90_s"] or 0)))


def whatif(source: Queryable, grid: dict[str, list[Any]], slos: dict[str, float]) -> WhatIf:
    """Predict the run's table for every setting of the cartesian `grid` (from `parse_grid`),
    and for the recorded settings (the self-check, against the recorded run's table)."""
    loaded = load_trace(source)
    changes = grid_settings(grid)
    settings = [loaded.settings({}), *(loaded.settings(c) for c in changes)]
    recorded_run, *predicted = predict(loaded.workload, loaded.prompts, settings, loaded.model)
    rows = [{"settings": c, **p.table} for c, p in zip(changes, predicted, strict=True)]
    return WhatIf(rows, loaded.recorded, recorded_run.table, loaded.model, slos,
                  best_row(rows, slos), loaded.notes)  # fmt: skip


# ---- one trace, many settings (the dashboard's What if page) -----------------------------------
@dataclass(slots=True)
class LoadedTrace:
    """A trace read once for many one-setting predictions: its workload and synthetic prompts,
    the cost model fitted on its steps, the recorded settings (flat) and KV pool, the recorded
    run's table and what the prediction should be read with (`notes`)."""

    workload: Workload
    prompts: list[list[int]]
    model: CostModel
    flat: dict[str, Any]
    pool: int
    recorded: dict[str, Any]
    notes: list[str]

    def settings(self, changes: dict[str, Any]) -> SchedulerSettings:
        """The recorded settings with `changes` (GRID_KEYS), validated (ValueError: why not)."""
        return resolve(self.flat, changes, self.pool)

    def predict(self, changes: dict[str, Any]) -> Prediction:
        return simulate(self.workload, self.prompts, self.settings(changes), self.model)


def trace_notes(flat: dict[str, Any], model: CostModel) -> list[str]:
    """What a prediction over this trace should be read with."""
    notes = []
    if flat.get("async_scheduling"):
        notes.append(
            "the run was recorded with async scheduling: the simulated scheduler runs one step "
            "at a time, each timed by the model fitted on the steps' own times"
        )
    if not model.has_context:
        notes.append(
            "the trace's steps have no num_context_tokens (recorded before it existed): the model "
            "has no attention term"
        )
    return notes


def load_trace(source: Queryable) -> LoadedTrace:
    """Read a trace once for many `LoadedTrace.predict` calls. A trace that cannot be predicted
    (no recorded configuration, no request, fewer than two steps, no pool size) raises
    ValueError saying why."""
    workload = load_workload(source)
    if not workload.requests:
        raise ValueError("the trace holds no request: nothing to predict")
    flat = recorded_flat(workload)
    model = fit_cost_model(source, small_step_tokens(flat))
    pool = flat.get("num_kv_blocks") or recorded_pool(source)
    if pool is None:
        raise ValueError("the trace records no KV pool size (no step has kv_total_blocks)")
    prompts = synthetic_prompts(workload, _VOCAB)
    return LoadedTrace(workload, prompts, model, flat, int(pool), recorded_table(source),
                       trace_notes(flat, model))  # fmt: skip
