"""The checkers of lesson 10's exercises (see viz/exercises.py): each measures, from the
learner's own run, the quantity its exercise asks the learner to predict."""

from __future__ import annotations

from typing import Any

import pandas as pd

from stepscope.viz.exercises import exercise, trace_df

# --- 10 · a window gives memory back ---------------------------------------------------------


def _blocks(trace: Any) -> pd.DataFrame:
    """Per step, the blocks each KV cache group held and each group's window (0: keeps all)."""
    steps = trace_df(
        trace, "SELECT step, kv_blocks_by_group, kv_group_windows FROM steps ORDER BY step"
    )
    steps = steps[steps.kv_blocks_by_group.notna()]
    if steps.empty:
        raise ValueError("the trace has no steps with blocks per KV cache group")
    return steps


def _sliding(blocks: Any, windows: Any) -> list[int]:
    return [int(b) for b, w in zip(blocks, windows, strict=True) if w]


@exercise(
    "10.1",
    answer="(the full-attention group's blocks, a sliding-window group's most blocks)",
    run="the hybrid run's trace (db_on)",
    quantity="kv_blocks_by_group in the last step of `steps`, split by kv_group_windows",
)
def _10_1(trace: Any) -> tuple[int, int]:
    last = _blocks(trace).iloc[-1]
    blocks, windows = list(last.kv_blocks_by_group), list(last.kv_group_windows)
    full = [int(b) for b, w in zip(blocks, windows, strict=True) if not w]
    sliding = _sliding(blocks, windows)
    if not full or not sliding:
        raise ValueError("the run has no sliding-window group: is the hybrid manager on?")
    return full[0], max(sliding)


@exercise(
    "10.2",
    answer="the most blocks any sliding-window group held in any step (int)",
    run="the hybrid run's trace with the smaller budget",
    quantity="the largest sliding-window entry of kv_blocks_by_group over the run's steps",
)
def _10_2(trace: Any) -> int:
    steps = _blocks(trace)
    most = [
        max(_sliding(b, w), default=0)
        for b, w in zip(steps.kv_blocks_by_group, steps.kv_group_windows, strict=True)
    ]
    if not max(most, default=0):
        raise ValueError("the run has no sliding-window group: is the hybrid manager on?")
    return max(most)


@exercise(
    "10.3",
    answer="(blocks held in all in the last step with the hybrid manager on, with it off)",
    run="(db_on, db_off): the two runs' traces",
    quantity="the sum of kv_blocks_by_group in each run's last step",
)
def _10_3(run: tuple[Any, Any]) -> tuple[int, int]:
    on, off = run
    return tuple(int(sum(_blocks(t).iloc[-1].kv_blocks_by_group)) for t in (on, off))
