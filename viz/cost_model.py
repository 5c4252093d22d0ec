"""The what-if cost model: how long an engine step takes, fitted on a trace's own steps.

Each recorded step's own compute time (`queries.STEPS_WITH_OWN_TIME`: from its start, or from the
end of the step before it where steps overlap under async scheduling, to its end) is fitted by
least squares as

    fixed + prefill tokens x a + decode tokens x b + context tokens x c

(`num_context_tokens`: the tokens the step's requests attend to), every coefficient kept
non-negative (a step never gets cheaper with more work).

A run on GGUF blocks has two kinds of step (engine/models/linear.py): up to
`quantized_max_tokens` tokens run the quantized kernels, bound by the bytes they read and slower
per token; more tokens run the dequantized copy through the dense GEMM. On SmolLM2 a 4-token
decode took 27 ms and a 5-token one 22 ms, a drop no single line through both can follow: the
small steps are then fitted on their own (`small_max_tokens`), where the trace holds at least
`MIN_REGIME_STEPS` of each kind, and the model times each step by its kind.

Between steps the engine spends time of its own (outputs out, new requests in): the mean gap from
one step's end to the next one's start while requests were in the engine is added after every step
where it is at least `GAP_MATTERS` of the mean step; an idle engine starts its first step `wake_s`
after a request reaches it (the recorded mean). viz/whatif.py times its simulated steps with it.

A step whose worker got far less CPU than its threads could have used (explain's contention rule,
`explain.contended`, on the step's `cpu_s`, `worker_s` and `num_threads`) measured the machine,
not the step: such steps are left out of the fit. When most steps were contended, the trace was
taken on a busy machine: the fit runs on all of them and says so (`busy_machine`), and every
prediction inherits that machine's slowness. Steps without a recorded CPU time (older traces, GPU
workers) are never judged.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from stepscope.traces.backend.explain import contended
from stepscope.traces.backend.queries import STEPS_WITH_OWN_TIME
from stepscope.traces.backend.source import Queryable
from stepscope.traces.backend.units import format_seconds
from stepscope.traces.backend.workload import check_one_run

# The mean gap between steps is part of the model when it is at least this share of a step.
GAP_MATTERS = 0.01
# Steps of each kind needed to fit the small and large steps of a quantized run on their own.
MIN_REGIME_STEPS = 8


_TERMS = ("fixed_s", "prefill_token_s", "decode_token_s", "context_token_s")


@dataclass(frozen=True, slots=True)
class CostModel:
    """A step's own time: fixed + prefill tokens x a + decode tokens x b + context tokens x c;
    `gap_s` is added after each step (0 where the recorded gap does not matter)."""

    fixed_s: float
    prefill_token_s: float
    decode_token_s: float
    context_token_s: float
    gap_s: float = 0.0
    recorded_gap_s: float = 0.0  # the mean gap between steps while requests were in the engine
    # From the first request to reach an idle engine to the step that starts for it (the busy
    # loop waking; offline, `generate` adding the rest of its requests first).
    wake_s: float = 0.0
    num_steps: int = 0
    mean_step_s: float = 0.0
    mean_abs_error_s: float = 0.0  # of the fitted step times against the recorded ones
    rms_error_s: float = 0.0
    has_context: bool = True  # False: the trace's steps have no num_context_tokens
    # The steps whose worker got too little CPU (`explain.contended`), their worker's CPU time
    # over what its threads could have used and over wall time, and their mean own time.
    contended_steps: int = 0
    contended_cpu_share: float | None = None
    contended_cpu_cores: float | None = None
    contended_mean_step_s: float = 0.0
    busy_machine: bool = False  # most steps contended: fitted on all of them all the same
    # A quantized run's steps of at most this many tokens, timed by `small_terms` (fixed,
    # prefill, decode, context; fitted on `small_steps` of them); 0: one kind of step.
    small_max_tokens: int = 0
    small_terms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    small_steps: int = 0

    @property
    def steps_left_out(self) -> int:
        return 0 if self.busy_machine else self.contended_steps

    def step_s(self, prefill: int, decode: int, context: int) -> float:
        if prefill + decode <= self.small_max_tokens:
            fixed, a, b, c = self.small_terms
            return fixed + prefill * a + decode * b + context * c
        return (
            self.fixed_s
            + prefill * self.prefill_token_s
            + decode * self.decode_token_s
            + context * self.context_token_s
        )

    def coefficients(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in (*_TERMS, "gap_s")}

    def terms_text(self) -> str:
        """What a step takes, in words: one line of terms, or one for each kind of step."""
        large = _terms_text(self.fixed_s, self.prefill_token_s, self.decode_token_s,
                            self.context_token_s)  # fmt: skip
        if not self.small_max_tokens:
            return large
        return (
            f"{large}; steps of up to {self.small_max_tokens} tokens (the quantized kernels, "
            f"{self.small_steps} of the steps fitted) take {_terms_text(*self.small_terms)}"
        )


def _terms_text(fixed: float, prefill: float, decode: float, context: float) -> str:
    return (
        f"{format_seconds(fixed)} + {format_seconds(prefill)} per prefill token + "
        f"{format_seconds(decode)} per decode token + {format_seconds(context)} per context token"
    )


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |x b - y| with every b >= 0: the best unconstrained fit over each subset of columns
    whose coefficients all come out non-negative (exact for the few columns here)."""
    best, best_error = np.zeros(x.shape[1]), float(np.sum(y**2))
    for size in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), size):
            sub = x[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            error = float(np.sum((sub @ coef - y) ** 2))
            if error < best_error - 1e-18:
                best, best_error = np.zeros(x.shape[1]), error
                best[list(cols)] = coef
    return best


_FIT_STEPS = f"""
SELECT dp_rank, start_ns, end_ns, own_s, coalesce(num_prefill_tokens, 0) AS prefill,
       coalesce(num_decode_tokens, 0) AS decode, num_context_tokens AS context, cpu_s, worker_s,
       num_threads
FROM ({STEPS_WITH_OWN_TIME}) ORDER BY dp_rank, start_ns
"""
_ENGINE_TIMES = """
SELECT dp_rank, queued_ns, finished_ns FROM requests
WHERE queued_ns IS NOT NULL AND finished_ns IS NOT NULL
"""


def between_steps(steps: pd.DataFrame, requests: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Seconds the engine spent outside steps, on each rank: the gaps from a step's end to the
    next one's start while some request was in the engine (queued before the gap, finished
    after it), and the wake-ups, from the first request to reach an idle engine to the step that
    started for it (idle time itself is neither)."""
    gaps, wakes = [], []
    for rank, group in steps.groupby("dp_rank"):
        mine = requests[requests["dp_rank"] == rank]
        queued = np.sort(mine["queued_ns"].to_numpy())
        finished = np.sort(mine["finished_ns"].to_numpy())
        starts = group["start_ns"].to_numpy()
        # Before each step: the end of the latest step before it (none before the first).
        before = np.concatenate(
            [[np.iinfo(np.int64).min], np.maximum.accumulate(group["end_ns"].to_numpy())[:-1]]
        )
        inside = queued.searchsorted(before, "right") - finished.searchsorted(starts, "left")
        gap = (starts - before)[1:] / 1e9
        gaps.append(gap[(inside[1:] > 0) & (gap > 0)])
        idle = np.flatnonzero(inside <= 0)
        first = queued.searchsorted(before[idle], "right")
        found = first < len(queued)
        delay = (starts[idle][found] - queued[first[found]]) / 1e9
        wakes.append(delay[delay >= 0])
    empty = np.zeros(0)
    return (np.concatenate(gaps) if gaps else empty, np.concatenate(wakes) if wakes else empty)


def small_step_tokens(flat: dict) -> int:
    """The most tokens a step of the recorded run (`flat`: its EngineConfig by field name) ran
    on the quantized kernels; 0 where every step ran one kind of kernel."""
    if flat.get("quantization") != "gguf" or flat.get("quantized_max_tokens") is None:
        return 0
    return int(flat["quantized_max_tokens"])


def fit_cost_model(source: Queryable, small_max_tokens: int = 0) -> CostModel:
    """The cost model fitted on a trace's own steps (see the module docstring), its steps of
    at most `small_max_tokens` tokens apart (`small_step_tokens`). A trace holding several runs
    raises ValueError (`workload.check_one_run`)."""
    check_one_run(source)
    return fit_steps(source.df(_FIT_STEPS), source.df(_ENGINE_TIMES), small_max_tokens)


def step_time_ratio(model: CostModel, source: Queryable) -> float | None:
    """A trace's steps' own time over the time `model` gives the very same steps (their prefill,
    decode and context tokens): about 1 on the trace the model was fitted on; above 1, the steps
    ran slower than the model says for their work. For a run of the same steps as the recording
    only the machine's speed moves it (it slowed down between the runs, or was busy); for other
    steps, the model's own error on them too. None without steps."""
    steps = source.df(_FIT_STEPS)
    if steps.empty:
        return None
    modelled = sum(
        model.step_s(int(p), int(d), 0 if pd.isna(c) else int(c))
        for p, d, c in zip(steps["prefill"], steps["decode"], steps["context"], strict=True)
    )
    return float(steps["own_s"].sum() / modelled) if modelled > 0 else None


def _terms(steps: pd.DataFrame, has_context: bool) -> np.ndarray:
    """Each step's four terms: 1, prefill tokens, decode tokens, context tokens (0 without)."""
    context = steps["context"].to_numpy(float, na_value=0.0) if has_context else 0.0
    return np.column_stack(
        [np.ones(len(steps)), steps["prefill"].to_numpy(float),
         steps["decode"].to_numpy(float), np.zeros(len(steps)) + context]
    )  # fmt: skip


def _fit(steps: pd.DataFrame, has_context: bool) -> np.ndarray:
    """The four non-negative coefficients fitted on `steps` (the context term 0 without it)."""
    x = _terms(steps, has_context)
    coef = nonnegative_least_squares(x if has_context else x[:, :3], steps["own_s"].to_numpy(float))
    return np.append(coef, 0.0) if not has_context else coef


def fit_steps(steps: pd.DataFrame, requests: pd.DataFrame, small_max_tokens: int = 0) -> CostModel:
    """The cost model fitted on `steps` (the columns of `_FIT_STEPS`, by rank and start), less
    the contended ones unless most were; the gaps and wake-ups between all of them, with
    `requests` (`dp_rank`, `queued_ns`, `finished_ns`) saying when the engine held some. Steps
    of at most `small_max_tokens` tokens are fitted on their own where there are enough of
    both kinds."""
    if len(steps) < 2:
        raise ValueError("the trace holds fewer than two engine steps: nothing to fit a model to")
    cpu_s, worker_s, threads = (
        steps[c].to_numpy(float, na_value=np.nan) for c in ("cpu_s", "worker_s", "num_threads")
    )
    starved = contended(cpu_s, worker_s, worker_s * threads)
    count = int(starved.sum())
    busy = count > 0 and (2 * count > len(steps) or len(steps) - count < 2)
    fitted = steps[~starved] if count and not busy else steps
    has_context = bool(fitted["context"].notna().all())
    small = (fitted["prefill"] + fitted["decode"]).to_numpy() <= small_max_tokens
    if min(int(small.sum()), int((~small).sum())) < MIN_REGIME_STEPS:
        small_max_tokens, small = 0, np.zeros(len(fitted), bool)
    coef = _fit(fitted[~small], has_context)
    small_coef = _fit(fitted[small], has_context) if small.any() else np.zeros(4)
    y = fitted["own_s"].to_numpy(float)
    x = _terms(fitted, has_context)
    residual = np.where(small, x @ small_coef, x @ coef) - y
    gaps, wakes = between_steps(steps, requests)
    mean_gap = float(gaps.mean()) if len(gaps) else 0.0
    mean_step = float(y.mean())
    # What the contended steps got: CPU time over their threads' time and over wall time.
    cpu = float(cpu_s[starved].sum())
    share = cpu / float((worker_s * threads)[starved].sum()) if count else None
    cores = cpu / float(worker_s[starved].sum()) if count else None
    return CostModel(
        *(float(c) for c in coef),
        gap_s=mean_gap if mean_gap >= GAP_MATTERS * mean_step else 0.0,
        recorded_gap_s=mean_gap,
        wake_s=float(wakes.mean()) if len(wakes) else 0.0,
        num_steps=len(fitted),
        mean_step_s=mean_step,
        mean_abs_error_s=float(np.abs(residual).mean()),
        rms_error_s=float(np.sqrt(np.mean(residual**2))),
        has_context=has_context,
        contended_steps=count,
        contended_cpu_share=share,
        contended_cpu_cores=cores,
        contended_mean_step_s=float(steps["own_s"][starved].mean()) if count else 0.0,
        busy_machine=busy,
        small_max_tokens=small_max_tokens,
        small_terms=tuple(float(c) for c in small_coef),
        small_steps=int(small.sum()),
    )
