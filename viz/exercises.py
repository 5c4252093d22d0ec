"""Checked exercises for the tutorials (stepscope.viz.exercises): each lesson's exercises end in
`check("NN.k", answer=..., run=...)`, which measures the quantity the exercise asks about from the
learner's own run and says whether the answer holds, and what the run shows when it does not.
The checkers themselves, one small function per exercise, live in `exercises_00_04.py`,
`exercises_05_09.py` and `exercises_10_14.py`, registered here by lesson and exercise number.

The right answer is never written into a notebook: a checker derives it from `run` (a trace, the
`LLM` that recorded one, a table the lesson's code built, a simulator result), so it holds for the
learner's settings, whatever they chose. `check("NN")` lists a lesson's exercises and what to pass;
`check("NN.k")` without an answer says how to call it and does nothing else, so a notebook still
runs top to bottom with its exercises unanswered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

Measure = Callable[[Any], Any]
Holds = Callable[[Any, Any], bool]


@dataclass(frozen=True, slots=True)
class Exercise:
    key: str  # "03.2": the lesson's number, then the exercise's
    answer: str  # what the learner passes as `answer`
    run: str  # what the learner passes as `run`
    quantity: str  # what the checker measures from `run`: where to look when an answer fails
    measure: Measure  # `run` -> the value the answer must match
    holds: Holds  # (answer, measured) -> whether the answer holds


EXERCISES: dict[str, Exercise] = {}


def plain(value: Any) -> Any:
    """numpy scalars, Series and nested sequences as plain Python, so they compare and print."""
    if isinstance(value, pd.Series | np.ndarray):
        value = value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, set | frozenset):
        return frozenset(plain(v) for v in value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    return value


def _equal(answer: Any, measured: Any) -> bool:
    return plain(answer) == plain(measured)


def exercise(key: str, *, answer: str, run: str, quantity: str, holds: Holds = _equal):
    """Registers the decorated function as the measure of exercise `key`."""

    def register(measure: Measure) -> Measure:
        EXERCISES[key] = Exercise(key, answer, run, quantity, measure, holds)
        return measure

    return register


def usage(key: str) -> str:
    ex = _registered()[key]
    return (
        f'check("{key}", answer=..., run=...)\n'
        f"    answer: {ex.answer}\n    run: {ex.run}\n    measured from your run: {ex.quantity}"
    )


def _registered() -> dict[str, Exercise]:
    """Every lesson's checkers (imported on first use: they import this module's helpers)."""
    from stepscope.viz import exercises_00_04, exercises_05_09, exercises_10_14  # noqa: F401

    return EXERCISES


def check(key: str, answer: Any = None, run: Any = None) -> bool:
    """Whether `answer` holds on the learner's `run` for exercise `key` ("NN.k"); prints a
    "right:" or "not yet:" line. `check("NN")` lists lesson NN's exercises; without an answer or
    a run it prints how to call it and returns False."""
    exercises = _registered()
    if key not in exercises:
        lesson = [k for k in exercises if k.split(".")[0] == key]
        if not lesson:
            raise ValueError(f"no exercise {key!r}; known: {', '.join(sorted(exercises))}")
        print(f"Lesson {key}'s exercises: answer one, then call its check.")
        for k in sorted(lesson, key=lambda k: int(k.split(".")[1])):
            print(usage(k))
        return False
    ex = exercises[key]
    if answer is None or run is None:
        print("To check your answer, pass it and your run:\n" + usage(key))
        return False
    try:
        measured = ex.measure(run)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{key}: could not measure your run ({error!r}); pass {ex.run}") from error
    shown, seen = _show(answer), _show(measured)
    if ex.holds(answer, measured):
        print(f"right: {key}: your answer {shown} holds; your run shows {seen} ({ex.quantity})")
        return True
    print(f"not yet: {key}: your answer {shown}; your run shows {seen} (its {ex.quantity})")
    return False


def _show(value: Any) -> str:
    """A value as the learner wrote it: sets sorted, numpy and pandas values as plain Python."""
    value = plain(value)
    if isinstance(value, frozenset):
        return "{" + ", ".join(map(repr, sorted(value))) + "}"
    return repr(value)


# --- reading a learner's run ----------------------------------------------------------------


class _Live:
    """A live `LLM` as a trace source for the queries module: its query_traces, with the $n
    parameters written into the SQL as quoted literals (query_traces takes none)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def df(self, sql: str, params: Iterable[Any] | None = None) -> pd.DataFrame:
        for i, value in reversed(list(enumerate(params or (), 1))):
            sql = sql.replace(f"${i}", "'" + str(value).replace("'", "''") + "'")
        return self.llm.query_traces(sql)


def with_store(trace: Any, read: Callable[[Any], Any]) -> Any:
    """`read(store)` on a live `LLM`, an open TraceStore, or a trace file's path (read-only)."""
    if hasattr(trace, "query_traces"):
        return read(_Live(trace))
    if hasattr(trace, "df"):
        return read(trace)
    from stepscope.traces.backend.store import TraceStore

    with TraceStore(Path(trace), read_only=True) as store:
        return read(store)


def trace_df(trace: Any, sql: str) -> pd.DataFrame:
    """SQL on a trace: a live `LLM` (query_traces), an open TraceStore, or a trace file's path."""
    if hasattr(trace, "query_traces"):
        return trace.query_traces(sql)
    if hasattr(trace, "df"):
        return trace.df(sql)
    from stepscope.traces.backend.store import TraceStore

    with TraceStore(Path(trace), read_only=True) as store:
        return store.df(sql)


def sql_ids(ids: Iterable[str]) -> str:
    """A SQL list of request ids, quoted."""
    quoted = ", ".join("'" + str(i).replace("'", "''") + "'" for i in ids)
    return f"({quoted})"


def request_steps(trace: Any, ids: Iterable[str]) -> pd.DataFrame:
    """One row per request per step: step, request_id, num_tokens (the tokens it computed)."""
    return trace_df(
        trace,
        "SELECT step, request_id, num_tokens FROM step_requests "
        f"WHERE request_id IN {sql_ids(ids)} ORDER BY step",
    )


def first_token_steps(trace: Any, prompts: Mapping[str, int]) -> list[int]:
    """For each request (id -> prompt tokens), the step that sampled its first token (the one
    whose tokens complete the prompt), counted from the first step any of them ran in."""
    rows = request_steps(trace, prompts)
    if rows.empty:
        raise ValueError(f"the trace has no steps for {list(prompts)}")
    first = int(rows.step.min())
    found = []
    for rid, n_prompt in prompts.items():
        own = rows[rows.request_id == rid]
        done = own[own.num_tokens.cumsum() >= n_prompt]
        if done.empty:
            raise ValueError(f"{rid}: its steps computed fewer than {n_prompt} prompt tokens")
        found.append(int(done.step.iloc[0]) - first)
    return found


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def within(rel: float) -> Holds:
    """Holds when the answer is within `rel` of the measurement (relative: byte counts)."""
    return lambda answer, measured: math.isclose(float(answer), float(measured), rel_tol=rel)


def each(measure: Measure) -> Measure:
    """`measure` over one run, or over a mapping of runs (setting -> run, e.g. {128: df, 256:
    df}), answered the same way (setting -> answer)."""

    def over(run: Any) -> Any:
        if isinstance(run, Mapping) and not isinstance(run, pd.DataFrame):
            return {label: measure(r) for label, r in run.items()}
        return measure(run)

    return over


def near(tolerance: float) -> Holds:
    """Holds when the answer is within `tolerance` (absolute) of the measurement."""
    return lambda answer, measured: abs(float(answer) - float(measured)) <= tolerance
