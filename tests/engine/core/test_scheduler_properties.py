"""Scheduler + KVCacheManager under random traffic: arrivals, aborts and steps, with the pool,
queue and budget invariants checked after every one of them (stage 3).

A fake runner samples random tokens, so no model is needed. Pools and budgets are small, so
requests are short of blocks, get preempted and share prefixes often.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from stepscope.engine.core.kv_cache_manager import KVCacheManager, cdiv
from stepscope.engine.core.request import Request, RequestStatus
from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput
from stepscope.engine.sampling_params import SamplingParams

EOS = 0
STOP_TOKEN = 3
SHARED_PREFIX = list(range(500, 516))  # some prompts start with part of this
MAX_MODEL_LEN = 64


def check_invariants(scheduler: Scheduler) -> None:
    """Everything that must hold between two calls into the scheduler."""
    kv = scheduler.kv
    pool = kv.pool
    held = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)

    # Ref counts: never negative, and exactly the number of requests holding the block.
    for block in pool.blocks:
        assert block.ref_cnt >= 0, block
        assert block.ref_cnt == held[block.block_id], block
    # A block is in the free queue iff nobody holds it; the queue has no duplicates.
    free = [b.block_id for b in pool.free_queue]
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert pool.num_free_blocks + len(held) == pool.num_blocks
    # The prefix index points at blocks that carry the hash they are indexed by.
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash

    running = [r.request_id for r in scheduler.running]
    waiting = [r.request_id for r in scheduler.waiting]
    assert len(running) == len(set(running)) and len(waiting) == len(set(waiting))
    assert not set(running) & set(waiting)
    assert set(running) | set(waiting) == set(scheduler.requests)
    assert len(running) <= scheduler.max_num_seqs
    assert set(kv.req_to_blocks) == set(running)  # waiting and finished requests hold nothing

    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        blocks = kv.req_to_blocks[request.request_id]
        assert len({b.block_id for b in blocks}) == len(blocks)
        assert request.num_computed_tokens <= request.num_tokens
        # Enough blocks for the KV already booked, and no more.
        assert len(blocks) == cdiv(request.num_computed_tokens, kv.block_size)
        # A cached block a request holds carries that request's own tokens.
        for i, block in enumerate(blocks):
            if block.block_hash is not None:
                assert block.block_hash == request.block_hashes[i]
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0


def check_step(scheduler: Scheduler, out: SchedulerOutput, needed: dict[str, int]) -> None:
    """What one SchedulerOutput must respect; `needed` is each request's tokens to catch up."""
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    running = {r.request_id for r in scheduler.running}
    for req_id, n in out.num_scheduled_tokens.items():
        assert req_id in running
        assert 1 <= n <= needed[req_id]
    for req_id in out.preempted_req_ids:
        assert req_id not in out.num_scheduled_tokens
        assert scheduler.requests[req_id].status == RequestStatus.PREEMPTED
    new_ids = [r.req_id for r in out.scheduled_new_reqs]
    cached_ids = out.scheduled_cached_reqs.req_ids
    assert sorted(new_ids + cached_ids) == sorted(out.num_scheduled_tokens)
    for new in out.scheduled_new_reqs:
        request = scheduler.requests[new.req_id]
        assert new.token_ids == request.all_token_ids
        assert new.block_ids == scheduler.kv.block_ids(new.req_id)


def fake_runner_output(
    scheduler: Scheduler, out: SchedulerOutput, sample: random.Random | list[int]
) -> ModelRunnerOutput:
    """A token for each request whose chunk reached its last known token; [] mid-prefill."""
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for i, req_id in enumerate(req_ids):
        request = scheduler.requests.get(req_id)
        if request is None or request.num_computed_tokens < request.num_tokens:
            sampled.append([])
        elif isinstance(sample, random.Random):
            sampled.append([sample.randrange(10)])
        else:
            sampled.append([sample[i % len(sample)]])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def tokens_to_catch_up(scheduler: Scheduler) -> dict[str, int]:
    return {r.request_id: r.num_tokens - r.num_computed_tokens for r in scheduler.requests.values()}


def _params(max_tokens: int, min_tokens: int, ignore_eos: bool, use_stop_token: bool):
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(min_tokens, max_tokens),
        ignore_eos=ignore_eos,
        stop_token_ids=[STOP_TOKEN] if use_stop_token else [],
    )


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler | None = None
        self.next_id = 0
        self.unreported: set[str] = set()  # finished since the last schedule()

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        caching_and_chunking=st.tuples(st.booleans(), st.booleans()),
    )
    def make_engine(
        self, num_blocks: int, block_size: int, budget: int, max_num_seqs: int,
        caching_and_chunking: tuple[bool, bool],
    ) -> None:  # fmt: skip
        enable_caching, enable_chunked_prefill = caching_and_chunking
        kv = KVCacheManager(num_blocks, block_size, enable_caching)
        # As EngineCore sets it up: the context fits in the pool (and, unchunked, in one step).
        max_model_len = min(MAX_MODEL_LEN, num_blocks * block_size)
        if not enable_chunked_prefill:
            max_model_len = min(max_model_len, budget)
        self.scheduler = Scheduler(
            kv, budget, max_num_seqs, max_model_len, enable_chunked_prefill=enable_chunked_prefill
        )

    @property
    def sched(self) -> Scheduler:
        assert self.scheduler is not None
        return self.scheduler

    @rule(
        prefix_len=st.sampled_from([0, 4, 8, 12, 16]),
        suffix_len=st.integers(0, 12),
        params=st.builds(
            _params,
            max_tokens=st.integers(1, 16),
            min_tokens=st.integers(0, 2),
            ignore_eos=st.booleans(),
            use_stop_token=st.booleans(),
        ),
    )
    def arrive(self, prefix_len: int, suffix_len: int, params: SamplingParams) -> None:
        suffix = [1000 * (self.next_id + 1) + i for i in range(suffix_len)]
        prompt = SHARED_PREFIX[:prefix_len] + suffix or [1]
        request = Request(f"r{self.next_id}", prompt, params, EOS, self.sched.kv.block_size)
        self.next_id += 1
        if len(prompt) >= self.sched.max_model_len:
            with pytest.raises(ValueError, match="context"):
                self.sched.add_request(request)
            return
        self.sched.add_request(request)

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        ids = sorted(self.sched.requests)
        if not ids:
            return
        req_id = ids[pick % len(ids)]
        self.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.unreported.add(req_id)

    @rule(
        # Plain tokens first: hypothesis favours early choices, and EOS ends a request at once.
        sampled=st.lists(st.sampled_from([7, 8, 9, EOS, STOP_TOKEN]), min_size=1, max_size=8),
        num_steps=st.integers(1, 4),
        abort_mid_step=st.booleans(),
    )
    def step(self, sampled: list[int], num_steps: int, abort_mid_step: bool) -> None:
        for i in range(num_steps):
            self.one_step(sampled[i:] + sampled[:i], abort_mid_step and i == 0)

    def one_step(self, sampled: list[int], abort_mid_step: bool) -> None:
        needed = tokens_to_catch_up(self.sched)
        out = self.sched.schedule()
        if not (out.num_scheduled_tokens or out.preempted_req_ids):
            # Never a wedge: a schedule runs nothing only when no request is left, and then the
            # finished requests wait for the next step that runs.
            assert not self.sched.has_unfinished_requests()
            assert out.finished_req_ids == []
            return
        assert sorted(out.finished_req_ids) == sorted(self.unreported)
        self.unreported.clear()
        check_step(self.sched, out, needed)
        check_invariants(self.sched)
        if out.preempted_req_ids:
            event("a request was preempted")
        if self.sched.last_stats.prefix_hit_tokens:
            event("a prefix-cache hit was admitted")
        runner_output = fake_runner_output(self.sched, out, sampled)
        if abort_mid_step and out.num_scheduled_tokens:
            req_id = next(iter(out.num_scheduled_tokens))
            self.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            self.unreported.add(req_id)
        outputs = self.sched.update_from_output(out, runner_output)
        for output in outputs:
            if output.finish_reason is not None:
                assert output.request_id not in self.sched.requests
                self.unreported.add(output.request_id)
        check_invariants(self.sched)

    @invariant()
    def pool_and_queues_are_consistent(self) -> None:
        if self.scheduler is not None:
            check_invariants(self.scheduler)

    def teardown(self) -> None:
        if self.scheduler is None:
            return
        drain(self.scheduler, random.Random(0))


def checked_step(scheduler: Scheduler, rng: random.Random) -> None:
    """One schedule and update, each checked (the step itself, then the invariants)."""
    needed = tokens_to_catch_up(scheduler)
    out = scheduler.schedule()
    check_step(scheduler, out, needed)
    check_invariants(scheduler)
    scheduler.update_from_output(out, fake_runner_output(scheduler, out, rng))
    check_invariants(scheduler)


def drain(scheduler: Scheduler, rng: random.Random, max_steps: int = 300) -> None:
    """Step until nothing is left (requests that can never fit are aborted); all blocks free."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        checked_step(scheduler, rng)
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    check_invariants(scheduler)
    kv = scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.req_to_blocks == {}
    assert not scheduler.has_unfinished_requests()


SchedulerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_seeded_random_workload_preempts_shares_prefixes_and_frees_everything() -> None:
    """A fixed heavier run, so preemption and prefix hits are known to have been exercised."""
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    for i in range(400):
        if rng.random() < 0.4:
            prefix = SHARED_PREFIX[: rng.choice([0, 8, 12])]
            prompt = prefix + [rng.randrange(1, 30) for _ in range(rng.randrange(1, 10))]
            params = SamplingParams(max_tokens=rng.randrange(1, 12))
            scheduler.add_request(Request(f"r{i}", prompt, params, EOS, 4))
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        checked_step(scheduler, rng)
    drain(scheduler, rng)
    assert scheduler.num_preemptions > 0
    assert kv.prefix_hits > 0
