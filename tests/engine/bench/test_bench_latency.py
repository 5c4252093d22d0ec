"""`stepscope bench latency --breakdown`: each part of a decode step timed around its call."""

from __future__ import annotations

import pytest

from stepscope.engine.bench.latency_parts import decode_breakdown, timers
from stepscope.engine.entrypoints.cli import build_parser
from stepscope.engine.entrypoints.llm import LLM


class Counter:
    def tick(self) -> int:
        return 1


def test_timers_time_each_call_and_give_the_methods_back() -> None:
    counter, replaced = Counter(), Counter()
    replaced.tick = lambda: 2  # an instance's own attribute survives the timers
    with timers([("a", counter, "tick"), ("b", replaced, "tick")]) as calls:
        assert (counter.tick(), counter.tick(), replaced.tick()) == (1, 1, 2)
    assert [len(calls["a"]), len(calls["b"])] == [2, 1]
    assert all(s >= 0 for s in calls["a"])
    assert "tick" not in vars(counter) and replaced.tick() == 2


def test_breakdown_parts_fit_inside_the_step_and_the_step_inside_the_token() -> None:
    with LLM(model="tiny-llama", num_kv_blocks=16) as llm:
        parts = dict(decode_breakdown(llm, list(range(100, 116)), 6))
    step = parts["engine core step"]
    inner = [parts[k] for k in parts if k.startswith("  worker:")]
    assert len(inner) == 4 and all(0 < s < step for s in inner)
    # Medians of parts need not add up under the median step exactly; nested, they come close.
    assert sum(inner) <= 1.25 * step
    # The front end's share may come out a hair negative when it is next to nothing (the
    # token's wall time is a difference of two runs), never by more than a step.
    assert parts["token (wall, generate)"] > 0 and parts["  beyond the step"] > -step


def test_breakdown_needs_the_uni_executor() -> None:
    from stepscope.engine.bench.latency import bench_latency

    args = build_parser().parse_args(
        ["bench", "latency", "--model", "tiny-llama", "--executor", "mp", "--breakdown"]
    )
    with pytest.raises(SystemExit, match="--executor uni"):
        bench_latency(args)
