"""The scheduler simulator of the seed's section 03, computed by the real scheduler (stage 3).

`simulate_step` puts the real `Scheduler` and `KVCacheManager` in the walkthrough's state
(`running` decode requests, each part way through its last KV block so its next token needs no new
block; a pool with exactly `free_blocks` free; prefix caching off), adds one waiting request of
`prompt_len` tokens and runs one real `schedule()`. The answer is read from the `SchedulerOutput`
and the KV manager, not recomputed: the seed's arithmetic is what the tests check it against.

`simulate_steps` runs the same state for many steps (`schedule()` + `update_from_output()` with
fake sampled tokens) and shows what the seed's calculator leaves out: a prefill chunked over
several steps, decodes crossing into a new block, a prefix-cache hit for a second request with
the same prompt, and recompute preemption when the pool runs dry.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from stepscope.engine.core.kv_cache_manager import KVCacheManager, cdiv
from stepscope.engine.core.request import Request
from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput
from stepscope.engine.sampling_params import SamplingParams

# The seed's walkthrough settings (section 03) and its two worked examples.
SEED_SETTINGS = {"budget": 2048, "block_size": 64, "max_num_seqs": 256}
GROUP_A = {"running": 64, "prompt_len": 3968, "free_blocks": 64}
GROUP_B = {"running": 127, "prompt_len": 1920, "free_blocks": 16}

_MAX_MODEL_LEN = 1 << 30  # no length limit gets in the way of the simulated requests
_NO_LIMIT = SamplingParams(max_tokens=None, temperature=0.0)
_FILLER_ID = "reserved"


@dataclass(frozen=True, slots=True)
class StepResult:
    """One `schedule()` of the walkthrough state, as the real scheduler decided it."""

    running: int
    prompt_len: int
    free_blocks: int
    budget: int
    block_size: int
    max_num_seqs: int
    decode_tokens: int  # running decodes scheduled this step (one token each)
    prefill_budget: int  # tokens left for the waiting request after the decodes
    first_chunk: int  # tokens of the waiting prompt this step (what it would get, if refused)
    num_chunks: int | None  # steps to prefill the prompt at this decode load (None: no budget)
    first_chunk_blocks: int  # KV blocks the first chunk needs
    admitted: bool
    blocks_short: int  # blocks missing for the first chunk (0 when they fit)
    blocked_by_max_seqs: bool  # refused because max_num_seqs requests already run
    kv_free_after: int  # free blocks once the step is scheduled

    @property
    def verdict(self) -> str:
        if self.admitted:
            return "admitted"
        if self.prefill_budget == 0:
            return "not admitted: no token budget left"
        if self.blocked_by_max_seqs:
            return f"not admitted: max_num_seqs ({self.max_num_seqs}) reached"
        return f"not admitted: short by {self.blocks_short} blocks"


@dataclass(frozen=True, slots=True)
class SimStep:
    """One step of `simulate_steps`: what the real scheduler scheduled, freed and preempted."""

    step: int
    decode_tokens: int
    prefill_tokens: int
    kv_free_before: int
    kv_free_after: int
    num_running: int
    num_waiting: int
    scheduled: dict[str, int]  # request id -> tokens this step
    new_blocks: dict[str, int]  # request id -> blocks allocated this step
    decodes_new_block: int  # running decodes that crossed into a new block
    prefix_hit_tokens: int
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    arrived: tuple[str, ...] = field(default=())


def _check(
    running: int, prompt_len: int, free_blocks: int, budget: int, block_size: int, max_num_seqs: int
) -> None:
    if running < 0:
        raise ValueError(f"running must be >= 0, got {running}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
    if free_blocks < 0:
        raise ValueError(f"free_blocks must be >= 0, got {free_blocks}")
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    if block_size < 2:
        # A decode can sit part way through a block only when a block holds 2 tokens or more.
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")


class _Tokens:
    """Distinct token ids, so no two simulated requests share a prefix unless asked to."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def take(self, n: int) -> list[int]:
        start = next(self._next)
        for _ in range(n - 1):
            next(self._next)
        return list(range(start, start + n))


def _sample(output: SchedulerOutput, scheduler: Scheduler, tokens: _Tokens) -> ModelRunnerOutput:
    """What a worker would send back: one new token for each request that reached its end."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append(tokens.take(1) if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def _build(
    running: int,
    free_blocks: int,
    budget: int,
    block_size: int,
    max_num_seqs: int,
    prefix_caching: bool,
    tokens: _Tokens,
) -> Scheduler:
    """A real scheduler with `running` decodes in flight and exactly `free_blocks` free blocks.

    The decodes get there the real way: admitted, prefilled in one step, one token sampled. Each
    prompt is shorter than a block, so the next token's slot is already allocated (mid-block);
    their lengths are staggered so that, over many steps, they cross block boundaries at
    different steps.
    """
    num_blocks = running + free_blocks
    kv = KVCacheManager(max(num_blocks, 1), block_size, enable_caching=prefix_caching)
    if num_blocks == 0:
        # A pool needs a block: hold the only one outside the scheduler.
        filler = Request(_FILLER_ID, tokens.take(1), _NO_LIMIT, None, block_size)
        kv.allocate_slots(filler, 1)
    lengths = [1 + i * (block_size - 1) // running for i in range(running)]
    scheduler = Scheduler(
        kv,
        max_num_batched_tokens=max(budget, sum(lengths)),
        max_num_seqs=max(max_num_seqs, running),
        max_model_len=_MAX_MODEL_LEN,
    )
    if running:
        for i, length in enumerate(lengths):
            scheduler.add_request(
                Request(f"d{i}", tokens.take(length), _NO_LIMIT, None, block_size)
            )
        warmup = scheduler.schedule()
        scheduler.update_from_output(warmup, _sample(warmup, scheduler, tokens))
    scheduler.max_num_batched_tokens = budget
    scheduler.max_num_seqs = max_num_seqs
    return scheduler


def simulate_step(
    running: int,
    prompt_len: int,
    free_blocks: int,
    budget: int = 2048,
    block_size: int = 64,
    max_num_seqs: int = 256,
) -> StepResult:
    """One real `schedule()` of the seed's walkthrough state; see the module docstring."""
    _check(running, prompt_len, free_blocks, budget, block_size, max_num_seqs)
    tokens = _Tokens()
    scheduler = _build(running, free_blocks, budget, block_size, max_num_seqs, False, tokens)
    kv = scheduler.kv
    waiting = Request("waiting", tokens.take(prompt_len), _NO_LIMIT, None, block_size)
    scheduler.add_request(waiting)

    output = scheduler.schedule()
    stats = scheduler.last_stats
    admitted = waiting.request_id in output.num_scheduled_tokens
    decode_tokens = stats.num_decode_tokens
    running_tokens = output.total_num_scheduled_tokens
    if admitted:
        first_chunk = output.num_scheduled_tokens[waiting.request_id]
        running_tokens -= first_chunk
        first_chunk_blocks = len(kv.block_ids(waiting.request_id))
    prefill_budget = budget - running_tokens
    if not admitted:
        # What the waiting request would have asked `allocate_slots` for.
        first_chunk = min(prompt_len, prefill_budget)
        first_chunk_blocks = cdiv(first_chunk, block_size)
    blocked_by_max_seqs = not admitted and len(scheduler.running) >= max_num_seqs
    blocks_short = 0 if admitted else max(first_chunk_blocks - kv.num_free_blocks, 0)
    return StepResult(
        running=running,
        prompt_len=prompt_len,
        free_blocks=free_blocks,
        budget=budget,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        decode_tokens=decode_tokens,
        prefill_budget=prefill_budget,
        first_chunk=first_chunk,
        num_chunks=cdiv(prompt_len, prefill_budget) if prefill_budget > 0 else None,
        first_chunk_blocks=first_chunk_blocks,
        admitted=admitted,
        blocks_short=blocks_short,
        blocked_by_max_seqs=blocked_by_max_seqs,
        kv_free_after=stats.kv_free_after,
    )


def simulate_steps(
    running: int,
    prompt_len: int,
    free_blocks: int,
    budget: int = 2048,
    block_size: int = 64,
    max_num_seqs: int = 256,
    *,
    num_steps: int = 24,
    output_len: int = 8,
    repeat_prompt_at: int | None = None,
    prefix_caching: bool = True,
) -> list[SimStep]:
    """Run the walkthrough state for `num_steps` real steps.

    The waiting request (`p0`, `prompt_len` tokens, `output_len` tokens to generate) arrives at
    step 0; the running decodes (`d0`, `d1`, ...) keep generating. With `repeat_prompt_at`, a
    second request with the same prompt (`p1`) arrives at that step and, with prefix caching on,
    finds the blocks `p0` has filled so far in the cache.
    """
    _check(running, prompt_len, free_blocks, budget, block_size, max_num_seqs)
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    if output_len < 1:
        raise ValueError(f"output_len must be at least 1, got {output_len}")
    tokens = _Tokens()
    scheduler = _build(
        running, free_blocks, budget, block_size, max_num_seqs, prefix_caching, tokens
    )
    params = SamplingParams(max_tokens=output_len, temperature=0.0)
    prompt = tokens.take(prompt_len)
    arrivals = {0: [Request("p0", prompt, params, None, block_size)]}
    if repeat_prompt_at is not None:
        arrivals.setdefault(repeat_prompt_at, []).append(
            Request("p1", prompt, params, None, block_size)
        )

    steps: list[SimStep] = []
    for step in range(num_steps):
        arrived = arrivals.get(step, [])
        for request in arrived:
            scheduler.add_request(request)
        output = scheduler.schedule()
        stats = scheduler.last_stats
        new_blocks = {r.req_id: len(r.block_ids) for r in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        decodes_new_block = 0
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            new_blocks[req_id] = len(blocks)
            if blocks and output.num_scheduled_tokens[req_id] == 1:
                decodes_new_block += 1
        finished_before = set(scheduler.requests)
        scheduler.update_from_output(output, _sample(output, scheduler, tokens))
        steps.append(
            SimStep(
                step=step,
                decode_tokens=stats.num_decode_tokens,
                prefill_tokens=stats.num_prefill_tokens,
                kv_free_before=stats.kv_free_before,
                kv_free_after=stats.kv_free_after,
                num_running=stats.num_running,
                num_waiting=stats.num_waiting,
                scheduled=dict(output.num_scheduled_tokens),
                new_blocks=new_blocks,
                decodes_new_block=decodes_new_block,
                prefix_hit_tokens=stats.prefix_hit_tokens,
                preempted=stats.preempted,
                finished=tuple(sorted(finished_before - set(scheduler.requests))),
                arrived=tuple(r.request_id for r in arrived),
            )
        )
    return steps
