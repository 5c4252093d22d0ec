"""Where one stream's decode step goes (`stepscope bench latency --breakdown`): each part of a
step timed around its own call, in this process (the uni executor), after the timed runs.

The parts, outermost first: the engine core's step (schedule, the worker's step, update), and
inside the worker's step its input preparation, the model's forward (embedding, every layer,
the final norm; on GGUF blocks the fused decode's one C call), the LM head and the sampler.
Each is the median over the decode steps of one request (its prefill step left out); what a
token costs beyond the engine core's step (the front end: the request's outputs detokenized and
handed back) is the token's wall time less that step. The timers wrap the calls only while the
breakdown runs, so the ms/token table above them is measured without them. A span per part
would cost 15-40 us each: the trace keeps its step and crossing spans, and this is the finer
look a benchmark can afford.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any


def _timed(calls: list[float], fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)

    return wrapper


@contextmanager
def timers(targets: list[tuple[str, object, str]]):
    """Wrap each (label, object, method name) on the object itself; yields label -> the
    seconds of each call, in order; the methods are restored after."""
    calls: dict[str, list[float]] = {label: [] for label, _, _ in targets}
    # What each object held as its own attribute before (else the class's method shows again).
    own = [(obj, name, vars(obj).get(name)) for _, obj, name in targets]
    for label, obj, name in targets:
        setattr(obj, name, _timed(calls[label], getattr(obj, name)))
    try:
        yield calls
    finally:
        for obj, name, before in own:
            if before is None:
                delattr(obj, name)
            else:
                setattr(obj, name, before)


def decode_breakdown(llm, prompt: list[int], output_tokens: int) -> list[tuple[str, float]]:
    """(part, median seconds per decode step) for one greedy request of `output_tokens` tokens,
    then the token's wall time and what the front end adds to the engine core's step."""
    from stepscope.engine.sampling_params import SamplingParams

    core = llm.frontend.client.core  # uni executor: the engine core runs in this process
    runner = core.executor.worker.model_runner
    model = runner.model
    targets = [
        ("engine core step", core, "step"),
        ("  worker: prepare inputs", runner, "_prepare_inputs"),
        ("  worker: model forward (layers)", model, "forward"),
        ("  worker: LM head", model, "compute_logits"),
        ("  worker: sample", runner, "_sample"),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    with timers(targets) as calls:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - start
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    per_token = (wall - (time.perf_counter() - start)) / (output_tokens - 1)
    # The first call of each part is the prompt's step; steps with no work (the request gone)
    # take microseconds and fall below the median of the output_tokens - 1 decodes.
    parts = [(label, statistics.median(calls[label][1:])) for label, _, _ in targets]
    step = parts[0][1]
    return [*parts, ("token (wall, generate)", per_token), ("  beyond the step", per_token - step)]


def breakdown_lines(label: str, parts: list[tuple[str, float]]) -> list[str]:
    return [f"where a decode step goes, {label} (median per step):"] + [
        f"  {part:36s} {seconds * 1e3:7.2f} ms" for part, seconds in parts
    ]
