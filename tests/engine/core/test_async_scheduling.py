"""Async scheduling in the real engine core, on a fake model: the same tokens as one step at a
time, through stops, preemption, aborts, chunked prefill and prefix hits.

The fake worker keeps each request's tokens as the real model runner does (the prompt from
`NewRequestData`, then its own samples) and samples the next token from them by a fixed rule. So
a step scheduled before the last one's token is back can only run if the worker feeds that
token from its own sample, and the tokens do not depend on how steps were batched.
"""

from __future__ import annotations

import random
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.engine_core import EngineCore
from stepscope.engine.executor.abstract import Executor
from stepscope.engine.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from stepscope.engine.models.loader import resolve_model
from stepscope.engine.sampling_params import SamplingParams

NUM_BLOCKS = 14  # of 16 tokens: a few requests at once, and preemptions
VOCAB = 40
EOS = 1  # the fake model samples it about once in 40 tokens


def fake_model(tokens: list[int]) -> int:
    """The next token of a sequence: a function of the sequence alone, as greedy decoding is."""
    return (tokens[-1] * 7 + len(tokens) * 3 + tokens[0]) % VOCAB


class FakeWorker(Executor):
    """One in-process worker that runs every step the moment it is sent, in order."""

    def __init__(self, num_blocks: int = NUM_BLOCKS) -> None:
        self.num_blocks = num_blocks
        self.tokens: dict[str, list[int]] = {}  # prompt, then every token sampled
        self.computed: dict[str, int] = {}
        self.sampled: dict[str, int] = {}  # tokens sampled per request, thrown away or not

    def determine_num_kv_blocks(self) -> int:
        return self.num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def worker_configs(self) -> list[EngineConfig]:
        return []

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self._run(scheduler_output)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            assert self.computed[req_id] == num_computed, "the core and the worker disagree"
        sampled = []
        for req_id, n in so.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            end = self.computed[req_id] + n
            # Every token fed is one the worker has: a prompt token or one it sampled itself.
            assert end <= len(tokens), f"{req_id}: asked for a token the worker does not have"
            self.computed[req_id] = end
            if end < len(tokens):  # part way through its prompt
                sampled.append([])
                continue
            tokens.append(fake_model(tokens))
            self.sampled[req_id] = self.sampled.get(req_id, 0) + 1
            sampled.append(tokens[-1:])
        return ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled)


def workload(seed: int) -> list[tuple[int, EngineCoreRequest, int | None]]:
    """(step to arrive at, request, output tokens after which it is aborted or None)."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, VOCAB) for _ in range(32)]  # two blocks' worth of prefix hits
    out = []
    for i in range(14):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 50))]
        if i % 3 == 0:
            prompt = shared + prompt[:10]
        params = SamplingParams(
            temperature=0,
            max_tokens=None if i == 5 else rng.randrange(1, 30),  # 5: to the context's end
            ignore_eos=i in (5, 6),
            stop_token_ids=[rng.randrange(2, VOCAB)] if i % 4 == 1 else [],
        )
        request = EngineCoreRequest(f"r{i}", prompt, params, EOS, arrival_time=0.0)
        abort_after = rng.randrange(1, 6) if i % 5 == 2 else None
        out.append((rng.randrange(0, 12), request, abort_after))
    return out


@dataclass
class Run:
    results: dict[str, tuple[list[int], str | None]]  # request -> its tokens and finish reason
    worker: FakeWorker
    core: EngineCore
    left_in_flight: int = 0  # most steps a call of `EngineCore.step` left running
    # Decodes scheduled while the request's previous token was still in flight.
    decodes_behind_their_token: int = 0


def run(async_scheduling: bool, seed: int) -> Run:
    """Every request's (tokens, finish reason), as the engine core sent them out."""
    config = EngineConfig.create(
        model="tiny-llama", num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=32,
        max_num_seqs=6, async_scheduling=async_scheduling,
    )  # fmt: skip
    worker = FakeWorker()
    core = EngineCore(config, resolve_model("tiny-llama"), executor=worker)
    pending = workload(seed)
    r = Run({}, worker, core)
    abort_after = {req.request_id: after for _, req, after in pending if after is not None}
    calls = 0
    while pending or core.has_unfinished_requests() or core.batch_queue:
        for arrival in [p for p in pending if p[0] <= calls]:
            core.add_request(arrival[1])
            r.results[arrival[1].request_id] = ([], None)
            pending.remove(arrival)
        calls += 1
        in_flight = {q.request_id for q in core.scheduler.running if q.num_output_placeholders}
        step_before = core.scheduler.step_index
        for out in core.step().outputs:
            tokens, _ = r.results[out.request_id]
            r.results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
        if core.scheduler.step_index > step_before and core.batch_queue:  # one was scheduled
            scheduled = core.batch_queue[0].scheduler_output.num_scheduled_tokens
            r.decodes_behind_their_token += len(in_flight & scheduled.keys())
        r.left_in_flight = max(r.left_in_flight, len(core.batch_queue))
        for req_id, after in list(abort_after.items()):
            tokens, reason = r.results.get(req_id, ([], None))
            if reason is None and len(tokens) >= after:  # as a stop string in the API would
                core.abort_requests([req_id])
                r.results[req_id] = (tokens, "abort")
                del abort_after[req_id]
        assert calls < 5000, "the engine core stopped making progress"
    return r


def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time() -> None:
    """Eight seeded workloads, each run one step at a time and with async scheduling."""
    reasons: set[str | None] = set()
    preemptions = {False: 0, True: 0}
    for seed in range(8):
        sync, both = run(async_scheduling=False, seed=seed), run(async_scheduling=True, seed=seed)
        assert both.results == sync.results, f"seed {seed}"
        reasons |= {reason for _, reason in sync.results.values()}
        for r in (sync, both):
            preemptions[r is both] += r.core.scheduler.num_preemptions
            # Every block back, including those of requests that finished with a step in flight.
            assert r.core.kv_cache_manager.num_free_blocks == NUM_BLOCKS
            assert not r.core.kv_cache_manager.req_to_blocks and not r.core.scheduler.requests
        assert (sync.left_in_flight, both.left_in_flight) == (0, 1)
        # Decodes really ran behind their own last token: the worker fed it from its sample.
        assert sync.decodes_behind_their_token == 0 and both.decodes_behind_their_token > 0
        for req_id, (tokens, reason) in both.results.items():
            assert sync.worker.sampled.get(req_id, 0) == len(tokens)
            # A request that stops on a token (or is aborted) costs at most the one step
            # scheduled behind it; one that reaches max_tokens or the context's end none: no
            # step is scheduled past them.
            thrown_away = both.worker.sampled.get(req_id, 0) - len(tokens)
            assert thrown_away <= {"length": 0, "stop": 1, "abort": 1}[reason], (req_id, reason)
    assert reasons == {"length", "stop", "abort"}
    assert preemptions[False] > 0 and preemptions[True] > 0


@pytest.mark.parametrize("r1_max_tokens", [20, 2])
def test_a_request_preempted_with_its_token_in_flight_keeps_that_token(r1_max_tokens: int) -> None:
    """Two requests fill the pool; the next step preempts the later one, r1, while the step that
    samples its next token still runs. That token comes back to a waiting request and is kept:
    recomputed with the rest when r1 is admitted again, or, when it was r1's last, r1 finishes
    from the waiting queue."""
    config = EngineConfig.create(
        model="tiny-llama", num_kv_blocks=4, max_num_batched_tokens=64, async_scheduling=True
    )
    worker = FakeWorker(num_blocks=4)
    core = EngineCore(config, resolve_model("tiny-llama"), executor=worker)
    lengths, max_tokens = (31, 30), (20, r1_max_tokens)
    for i in range(2):  # each fills its second block within a few tokens
        params = SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True)
        core.add_request(EngineCoreRequest(f"r{i}", [2 + i] * lengths[i], params, EOS, 0.0))
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    preempted_in_flight = False
    while core.has_unfinished_requests() or core.batch_queue:
        r1 = core.scheduler.requests.get("r1")
        in_flight = r1 is not None and r1.num_output_placeholders > 0
        step_before = core.scheduler.step_index
        outputs = core.step().outputs
        if core.scheduler.step_index > step_before and "r1" in core.scheduler.last_stats.preempted:
            preempted_in_flight |= in_flight
        for out in outputs:
            got[out.request_id] += out.new_token_ids
    assert preempted_in_flight
    for i in range(2):
        expected = [2 + i] * lengths[i]
        for _ in range(max_tokens[i]):
            expected.append(fake_model(expected))
        assert got[f"r{i}"] == expected[lengths[i] :]
    assert core.kv_cache_manager.num_free_blocks == 4 and not core.scheduler.waiting
