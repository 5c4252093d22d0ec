"""The scheduler simulator: the budget walkthrough, answered by the real scheduler (stage 3).

`simulate_step` puts the real `Scheduler` and `KVCacheManager` in the walkthrough's state
(`running` decode requests, a pool with exactly `free_blocks` free, prefix caching off), adds one
waiting request of `prompt_len` tokens and runs one real `schedule()`. Every answer is read from
what the scheduler did, not worked out with a formula:

- the step's `SchedulerOutput` and KV manager give the decode tokens, what is left of the budget
  and, when the prompt gets in, its first chunk and the blocks that chunk took;
- a copy of the same state whose pool has room for the whole prompt is stepped, `schedule()` after
  `schedule()`, until the prompt is prefilled: the steps it took are `num_chunks`, and when the
  real step refused the prompt, the copy's first step says what it asked for (its first chunk and
  blocks; `blocks_short` is those blocks less the ones the real step left free).

By default every decode sits part way through its last block, so its next token fits in a slot
it already holds. `decodes_crossing` of them can instead sit at the end of a full block, so that
each needs a new block this step, as every decode does once every `block_size` tokens.

`simulate_steps` runs the same state for many steps (`schedule()` + `update_from_output()` with
fake sampled tokens) and shows what one step cannot: a prefill chunked over several steps,
decodes crossing into a new block, a prefix-cache hit for a second request with the same prompt,
and recompute preemption when the pool runs dry.

Both take a layer pattern (`layer_types`, `sliding_window`; `LAYER_PATTERNS` names two): by
default every layer attends to the whole context, one KV cache group, as before. A hybrid
pattern (Gemma 3: five sliding-window layers to each full-attention one) gives the real manager
one group per attention type (engine/core/kv_cache_utils.py): every block a request takes is
taken in each group, and the sliding-window groups give back what their window left behind, so
`SimStep.kv_blocks_by_group` shows them staying flat while the full-attention group grows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from stepscope.engine.core.kv_cache_manager import KVCacheManager, cdiv
from stepscope.engine.core.kv_cache_utils import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    KVCacheGroupSpec,
    get_kv_cache_groups,
    needs_null_block,
)
from stepscope.engine.core.request import Request
from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput
from stepscope.engine.sampling_params import SamplingParams

# The walkthrough's settings (budget, block size, sequence cap) and its two worked examples.
WALKTHROUGH_SETTINGS = {"budget": 2048, "block_size": 64, "max_num_seqs": 256}
GROUP_A = {"running": 64, "prompt_len": 3968, "free_blocks": 64}
GROUP_B = {"running": 127, "prompt_len": 1920, "free_blocks": 16}

# `num_chunks` is counted by stepping the scheduler; past this many steps it is left as None
# (a prompt that slow to get in is the answer already, and a slider must stay responsive).
MAX_CHUNK_STEPS = 128

# Layer patterns the simulator offers: (layer_types, sliding_window); None is every layer on
# full attention. Gemma 3 270M's 18 layers: five local (window 512) then one global, three times.
GEMMA3_LAYERS = ((SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)) * 3
LAYER_PATTERNS: dict[str, tuple[tuple[str, ...], int] | None] = {
    "All full attention": None,
    "Gemma 3: 5 local : 1 global, window 512": (GEMMA3_LAYERS, 512),
}

_MAX_MODEL_LEN = 1 << 30  # no length limit gets in the way of the simulated requests
_NO_LIMIT = SamplingParams(max_tokens=None, temperature=0.0)
_FILLER_ID = "reserved"
_WAITING_ID = "waiting"


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
    prefill_budget: int  # tokens left for the waiting request after the running requests
    first_chunk: int  # tokens of the waiting prompt this step (what it asked for, if refused)
    # Steps the scheduler took to prefill the whole prompt at this decode load, in a pool with
    # room for it (None: no budget left, or more than MAX_CHUNK_STEPS steps).
    num_chunks: int | None
    first_chunk_blocks: int  # KV blocks the first chunk takes (or asked for, if refused)
    admitted: bool
    blocks_short: int  # blocks missing for the first chunk (0 when they fit)
    blocked_by_max_seqs: bool  # refused because max_num_seqs requests already run
    kv_free_after: int  # free blocks once the step is scheduled
    decodes_new_block: int = 0  # running decodes that took a new block this step
    preempted: tuple[str, ...] = ()  # running requests preempted this step (no admission then)
    kv_blocks_by_group: tuple[int, ...] = ()  # blocks each KV cache group holds after the step
    kv_group_windows: tuple[int, ...] = ()  # each group's window (0: keeps every block)

    @property
    def verdict(self) -> str:
        if self.admitted:
            return "admitted"
        if self.prefill_budget == 0:
            return "not admitted: no token budget left"
        if self.blocked_by_max_seqs:
            return f"not admitted: max_num_seqs ({self.max_num_seqs}) reached"
        if self.preempted:
            return f"not admitted: the step preempted {', '.join(self.preempted)}"
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
    kv_blocks_by_group: tuple[int, ...] = ()  # blocks each KV cache group holds after the step
    kv_group_windows: tuple[int, ...] = ()  # each group's window (0: keeps every block)


def _check(
    running: int,
    prompt_len: int,
    free_blocks: int,
    budget: int,
    block_size: int,
    max_num_seqs: int,
    decodes_crossing: int,
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
    if not 0 <= decodes_crossing <= running:
        raise ValueError(
            f"decodes_crossing must be between 0 and running ({running}), got {decodes_crossing}"
        )


def kv_groups(
    layer_types: tuple[str, ...] | None, sliding_window: int | None
) -> list[KVCacheGroupSpec] | None:
    """The KV cache groups the real manager forms for this layer pattern (None: one group)."""
    if layer_types is None:
        return None
    return get_kv_cache_groups(tuple(layer_types), sliding_window)


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
    decodes_crossing: int = 0,
    groups: list[KVCacheGroupSpec] | None = None,
) -> Scheduler:
    """A real scheduler with `running` decodes in flight and exactly `free_blocks` free blocks.

    The decodes get there the real way: admitted, prefilled in one step, one token sampled. Each
    prompt fits in one block. The first `decodes_crossing` prompts fill their block exactly, so
    the sampled token's slot is in a block not yet allocated; the others are shorter, so the next
    token's slot is already theirs (mid-block), and their lengths are staggered so that, over
    many steps, they cross block boundaries at different steps. With several KV cache groups each
    decode holds its block in every group, and a window's null block is set aside too.
    """
    num_groups = len(groups) if groups else 1
    reserved = int(bool(groups) and needs_null_block(groups))
    num_blocks = running * num_groups + free_blocks
    kv = KVCacheManager(
        max(num_blocks, num_groups) + reserved, block_size, enable_caching=prefix_caching,
        kv_cache_groups=groups,
    )  # fmt: skip
    if num_blocks == 0:
        # A pool needs a block (one per group): hold them outside the scheduler.
        filler = Request(_FILLER_ID, tokens.take(1), _NO_LIMIT, None, block_size)
        kv.allocate_slots(filler, 1)
    lengths = [
        block_size if i < decodes_crossing else 1 + i * (block_size - 1) // running
        for i in range(running)
    ]
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


def _decodes_new_block(output: SchedulerOutput) -> int:
    """Running requests scheduled for one token that were given a new block for it."""
    cached = output.scheduled_cached_reqs
    return sum(
        1
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True)
        if blocks and output.num_scheduled_tokens[req_id] == 1
    )


def _prefill_with_room(
    running: int,
    prompt_len: int,
    budget: int,
    block_size: int,
    max_num_seqs: int,
    decodes_crossing: int,
    groups: list[KVCacheGroupSpec] | None = None,
) -> tuple[list[int], int]:
    """Step a copy of the state, with room for everything, until the waiting prompt is prefilled.

    Returns the prompt's chunks, one per step (empty if it never got in, cut short after
    MAX_CHUNK_STEPS), and the blocks its first chunk took. The pool is sized so that neither the
    prompt nor the decodes (one new block each every `block_size` steps) can run it dry, and one
    sequence slot is kept for the prompt, so only the token budget shapes the chunks.
    """
    tokens = _Tokens()
    decode_growth = running * (cdiv(MAX_CHUNK_STEPS, block_size) + 1)
    room = (cdiv(prompt_len, block_size) + decode_growth) * (len(groups) if groups else 1)
    scheduler = _build(
        running,
        room,
        budget,
        block_size,
        max(max_num_seqs, running + 1),
        False,
        tokens,
        decodes_crossing,
        groups,
    )
    waiting = Request(_WAITING_ID, tokens.take(prompt_len), _NO_LIMIT, None, block_size)
    scheduler.add_request(waiting)
    chunks: list[int] = []
    first_blocks = 0
    for _ in range(MAX_CHUNK_STEPS):
        output = scheduler.schedule()
        chunk = output.num_scheduled_tokens.get(_WAITING_ID, 0)
        if not chunk:
            break
        if not chunks:
            first_blocks = len(scheduler.kv.block_ids(_WAITING_ID))
        chunks.append(chunk)
        if waiting.num_computed_tokens >= prompt_len:
            return chunks, first_blocks
        scheduler.update_from_output(output, _sample(output, scheduler, tokens))
    return chunks, first_blocks


def simulate_step(
    running: int,
    prompt_len: int,
    free_blocks: int,
    budget: int = 2048,
    block_size: int = 64,
    max_num_seqs: int = 256,
    *,
    decodes_crossing: int = 0,
    layer_types: tuple[str, ...] | None = None,
    sliding_window: int | None = None,
) -> StepResult:
    """One real `schedule()` of the walkthrough state; see the module docstring."""
    _check(running, prompt_len, free_blocks, budget, block_size, max_num_seqs, decodes_crossing)
    groups = kv_groups(layer_types, sliding_window)
    tokens = _Tokens()
    scheduler = _build(
        running, free_blocks, budget, block_size, max_num_seqs, False, tokens, decodes_crossing,
        groups,
    )  # fmt: skip
    kv = scheduler.kv
    waiting = Request(_WAITING_ID, tokens.take(prompt_len), _NO_LIMIT, None, block_size)
    scheduler.add_request(waiting)

    output = scheduler.schedule()
    stats = scheduler.last_stats
    admitted = _WAITING_ID in output.num_scheduled_tokens
    prefill_budget = budget - output.total_num_scheduled_tokens
    first_chunk = first_chunk_blocks = 0
    if admitted:
        first_chunk = output.num_scheduled_tokens[_WAITING_ID]
        first_chunk_blocks = len(kv.block_ids(_WAITING_ID))
        prefill_budget += first_chunk

    chunks: list[int] = []
    if prefill_budget > 0:
        chunks, room_first_blocks = _prefill_with_room(
            running, prompt_len, budget, block_size, max_num_seqs, decodes_crossing, groups
        )
        if not admitted and chunks:
            first_chunk, first_chunk_blocks = chunks[0], room_first_blocks
    prefilled = sum(chunks) >= prompt_len
    blocked_by_max_seqs = not admitted and len(scheduler.running) >= max_num_seqs
    return StepResult(
        running=running,
        prompt_len=prompt_len,
        free_blocks=free_blocks,
        budget=budget,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        decode_tokens=stats.num_decode_tokens,
        prefill_budget=prefill_budget,
        first_chunk=first_chunk,
        num_chunks=len(chunks) if prefilled else None,
        first_chunk_blocks=first_chunk_blocks,
        admitted=admitted,
        blocks_short=0 if admitted else max(first_chunk_blocks - kv.num_free_blocks, 0),
        blocked_by_max_seqs=blocked_by_max_seqs,
        kv_free_after=stats.kv_free_after,
        decodes_new_block=_decodes_new_block(output),
        preempted=stats.preempted,
        kv_blocks_by_group=stats.kv_blocks_by_group,
        kv_group_windows=stats.kv_group_windows,
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
    decodes_crossing: int = 0,
    layer_types: tuple[str, ...] | None = None,
    sliding_window: int | None = None,
) -> list[SimStep]:
    """Run the walkthrough state for `num_steps` real steps.

    The waiting request (`p0`, `prompt_len` tokens, `output_len` tokens to generate) arrives at
    step 0; the running decodes (`d0`, `d1`, ...) keep generating. With `repeat_prompt_at`, a
    second request with the same prompt (`p1`) arrives at that step and, with prefix caching on,
    finds the blocks `p0` has filled so far in the cache.
    """
    _check(running, prompt_len, free_blocks, budget, block_size, max_num_seqs, decodes_crossing)
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    if output_len < 1:
        raise ValueError(f"output_len must be at least 1, got {output_len}")
    groups = kv_groups(layer_types, sliding_window)
    tokens = _Tokens()
    scheduler = _build(
        running,
        free_blocks,
        budget,
        block_size,
        max_num_seqs,
        prefix_caching,
        tokens,
        decodes_crossing,
        groups,
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
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            new_blocks[req_id] = len(blocks)
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
                decodes_new_block=_decodes_new_block(output),
                prefix_hit_tokens=stats.prefix_hit_tokens,
                preempted=stats.preempted,
                finished=tuple(sorted(finished_before - set(scheduler.requests))),
                arrived=tuple(r.request_id for r in arrived),
                kv_blocks_by_group=stats.kv_blocks_by_group,
                kv_group_windows=stats.kv_group_windows,
            )
        )
    return steps
