"""Async scheduling on the real engine (tiny-llama): the tokens of one step at a time, on both
executors, and step spans that show the overlap.

One mixed workload runs with `async_scheduling` off and on: a shared prompt prefix (prefix
hits), a long prompt in chunks with prompt logprobs, logprobs, a stop token id, a stop string (the
API side aborts the request in the engine core with steps in flight), n=2, max_tokens=1, and a KV
pool so small that requests are preempted.
"""

from __future__ import annotations

import pytest

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.config import EngineConfig
from stepscope.engine.executor.multiproc_executor import MultiprocExecutor
from stepscope.engine.executor.uniproc_executor import UniProcExecutor
from stepscope.engine.messages import CachedRequestData, NewRequestData, SchedulerOutput
from stepscope.engine.models.loader import resolve_model
from stepscope.engine.outputs import RequestOutput

ENGINE = {"model": "tiny-llama", "num_kv_blocks": 12, "max_num_batched_tokens": 32}
SHARED = "The history of the Roman Empire began long before the first emperor, " * 2
PROMPTS = [
    SHARED + "and the first question is",
    SHARED + "and the second question is",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 "
    "33 34 35 36 37 38 39 40",
    "Hello, my name is",
    "Once upon a time, in a land far away, there lived a",
    "The capital of France is a city that",
    "Two plus two is",
]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def mixed_params(llm: LLM) -> list[SamplingParams]:
    """Stops picked from the plain greedy tokens, so that each one fires part way through."""
    plain = [o.outputs[0] for o in llm.generate(PROMPTS, greedy(24), use_tqdm=False)]
    stop_string = plain[4].text[len(plain[4].text) // 2 :][:3]
    assert stop_string.strip(), plain[4].text
    return [
        greedy(24),
        greedy(24, logprobs=2),
        greedy(8, prompt_logprobs=1),
        greedy(30, stop_token_ids=[plain[3].token_ids[5]]),
        greedy(30, stop=[stop_string]),
        greedy(16, n=2),
        greedy(1),
    ]


def comparable(outputs: list[RequestOutput]) -> list[tuple]:
    return [
        (
            [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs],
            [c.logprobs for c in o.outputs],
            o.prompt_logprobs,
        )
        for o in outputs
    ]


def same_logprobs(got: list | None, expected: list | None) -> bool:
    """Per position a {token id: logprob} dict (or None): the same ids, values within 1e-4."""
    if got is None or expected is None:
        return got is expected
    return len(got) == len(expected) and all(
        (a is None and b is None)
        or (a is not None and b is not None and a.keys() == b.keys()
            and all(abs(a[k] - b[k]) < 1e-4 for k in a))
        for a, b in zip(got, expected, strict=True)
    )  # fmt: skip


def run(params: list[SamplingParams], **engine: object) -> tuple[list[tuple], int, dict]:
    """The workload's outputs, its preemptions, and the engine's counters after it."""
    with LLM(**ENGINE, **engine) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()
    return comparable(outputs), sum(o.metrics.num_preemptions for o in outputs), stats


@pytest.fixture(scope="module")
def one_step_at_a_time() -> tuple[list[SamplingParams], list[tuple]]:
    with LLM(**ENGINE) as llm:
        params = mixed_params(llm)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        reference = comparable(outputs)
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
    reasons = [o[0][0][1] for o in reference]
    assert reasons == ["length", "length", "length", "stop", "stop", "length", "length"]
    assert len(reference[4][0][0][0]) < 30  # the stop string ended it early, from the API side
    return params, reference


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_async_scheduling_gives_the_same_tokens(
    one_step_at_a_time, process_tree, executor: str
) -> None:
    params, reference = one_step_at_a_time
    with process_tree.adopting():  # the mp executor's processes die with the test
        got, preemptions, stats = run(params, executor=executor, async_scheduling=True)
    assert preemptions > 0
    assert [o[0] for o in got] == [o[0] for o in reference]  # tokens, stops and text
    # Logprobs too: the same ids, values equal to float32 rounding (batches differ).
    for (_, logprobs, prompt_logprobs), (_, ref_logprobs, ref_prompt) in zip(
        got, reference, strict=True
    ):
        for positions, ref_positions in [*zip(logprobs, ref_logprobs, strict=True),
                                         (prompt_logprobs, ref_prompt)]:  # fmt: skip
            assert same_logprobs(positions, ref_positions)
    # Every block back, including those of requests that stopped with a step behind them.
    assert stats["num_free_blocks"] == ENGINE["num_kv_blocks"] and stats["num_running"] == 0


# Each step's schedule span, and the end of its execute span (the output back).
STEP_PHASES = """
SELECT s.step,
       min(c.start_ns) FILTER (WHERE c.name = 'stepscope.schedule') AS schedule_start,
       min(c.end_ns) FILTER (WHERE c.name = 'stepscope.execute') AS execute_end
FROM steps s JOIN spans c ON c.parent_span_id = s.span_id AND c.trace_id = s.trace_id
GROUP BY s.step ORDER BY s.step
"""


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_spans_overlap_with_async_scheduling_only(tmp_path, async_scheduling: bool) -> None:
    """On, every step is scheduled while the step before it still runs: its schedule span starts
    before the previous step's execute span ends. Off, steps follow one another."""
    db = tmp_path / "run.duckdb"
    with LLM(**ENGINE, async_scheduling=async_scheduling, trace_db=db) as llm:
        llm.generate(PROMPTS[3:], greedy(8), use_tqdm=False)
        phases = llm.query_traces(STEP_PHASES)
    assert len(phases) >= 8
    overlaps = phases["schedule_start"].iloc[1:].values < phases["execute_end"].iloc[:-1].values
    assert overlaps.all() if async_scheduling else not overlaps.any()


def test_executors_feed_a_step_sent_early_with_the_token_of_the_step_before(process_tree) -> None:
    """Two steps of one request sent without waiting (a prefill, then the decode of the token it
    samples), and on the worker processes a call that every rank answers while both are out:
    each Future gets its own step's output, and the decode's token is the one a step at a time
    gives."""
    prompt = list(range(1000, 1010))
    params = greedy(2)
    steps = [
        SchedulerOutput(0, [NewRequestData("r", prompt, params, [0], 0, len(prompt))],
                        CachedRequestData(), {"r": 10}, 10, [], []),
        SchedulerOutput(1, [], CachedRequestData(["r"], [[]], [10]), {"r": 1}, 1, [], []),
    ]  # fmt: skip
    tokens = {}
    for executor_name in ("uni", "uni-sync", "mp"):
        config = EngineConfig.create(
            model="tiny-llama", num_kv_blocks=4, executor="mp" if executor_name == "mp" else "uni"
        )
        with process_tree.adopting():
            executor = (MultiprocExecutor if executor_name == "mp" else UniProcExecutor)(
                config, resolve_model("tiny-llama")
            )
        try:
            executor.init_kv_cache(4)
            if executor_name == "uni-sync":
                outputs = [executor.execute_model(so) for so in steps]
            else:
                futures = [executor.execute_model(so, non_block=True) for so in steps]
                assert len(executor.worker_configs()) == 1  # answered behind both steps
                # The workers' outputs came first, read off the socket during that call.
                assert executor_name == "uni" or all(f.done() for f in futures)
                outputs = [f.result() for f in futures]
            assert all(o.req_ids == ["r"] for o in outputs)
            tokens[executor_name] = [o.sampled_token_ids[0] for o in outputs]
        finally:
            executor.shutdown()
    assert tokens["uni"] == tokens["mp"] == tokens["uni-sync"]
