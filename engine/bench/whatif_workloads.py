"""The workloads of `stepscope bench whatif`: three recorded for real through `LLM`, and the
hand-made 1,000-request bursty chat mix its what-if grid is timed on.

Recorded (`record`): each `Plan` is a list of bursts, each burst one `LLM.generate` call of
token-id prompts with forced output lengths (`max_tokens`, `ignore_eos`), sent after a pause
once the burst before it has finished, as an offline job that gets its work in bursts sends it:

- `bursty_chat_plan`: chats of mixed prompt and output lengths in bursts of different sizes,
  every prompt long enough starting with the same 64-token system prompt (prefix-cache hits);
- `long_prompt_plan`: short chats in three bursts, the middle one led by one long prompt that
  the others queue behind while it is prefilled in chunks;
- `small_pool_plan`: one burst of long-output chats in a KV pool that holds about half of what
  it grows to, so that decoding preempts. One burst, because a second one arriving while the
  first decodes meets whichever preemptions the step times of that run have led to: two replays
  of the same setting then differed by 36-59% in p90 TTFT (12 chats), noise no prediction can
  be checked against.

Each plan carries the engine options it is recorded with: an explicit budget, `max_num_seqs`
and KV pool, sized from its own requests (the pool halved still holds its longest request).

`bursty_chat` builds the timing workload as a `Workload` directly (no model run): issue 40's
mix, prompts 16-1,000 tokens and outputs 16-256 in bursts of 20-60 chats; tests/viz use it too.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from typing import Any

from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces.backend.workload import RecordedRequest, Workload

BLOCK_SIZE = 16
SYSTEM_TOKENS = 64  # the system prompt every chat long enough starts with: four full blocks
# The recorded engines' budget and sequence cap: halving, doubling and capping at 8 all bind.
BUDGET = 256
MAX_NUM_SEQS = 16
# Chats are sampled as a chat client asks (the sampler's cost is in every decode step).
CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.95}


@dataclass(frozen=True, slots=True)
class Chat:
    prompt: list[int]  # token ids
    output_tokens: int  # forced: max_tokens with ignore_eos


@dataclass(frozen=True, slots=True)
class Burst:
    pause_s: float  # idle time after the burst before it has finished
    chats: list[Chat]


@dataclass(frozen=True, slots=True)
class Plan:
    """A workload to record: its bursts and the engine options it is recorded with."""

    name: str  # bursty_chat | long_prompt | small_pool
    title: str  # what it is, in words
    bursts: list[Burst]
    engine: dict[str, Any]  # LLM keywords: max_num_batched_tokens, max_num_seqs, num_kv_blocks

    @property
    def chats(self) -> list[Chat]:
        return [c for b in self.bursts for c in b.chats]


@dataclass(frozen=True, slots=True)
class ChatMix:
    """How many chats a plan draws and the ranges of their lengths, from one seed."""

    num_chats: int
    prompt_range: tuple[int, int]  # tokens, inclusive
    output_range: tuple[int, int]
    vocab_size: int
    seed: int = 0

    @property
    def lengths(self) -> str:
        (p0, p1), (o0, o1) = self.prompt_range, self.output_range
        return f"prompts {p0}-{p1} tokens, outputs {o0}-{o1}"


def _check_range(name: str, low: int, high: int) -> None:
    if not 1 <= low <= high:
        raise ValueError(f"{name}: lengths need 1 <= min <= max, got {low}-{high}")


def _blocks(chat: Chat) -> int:
    """The KV blocks a chat holds once it has generated its last token."""
    return -(-(len(chat.prompt) + chat.output_tokens) // BLOCK_SIZE)


def _engine(bursts: list[Burst], pool: int) -> dict[str, Any]:
    longest = max(_blocks(c) for b in bursts for c in b.chats)
    return {
        "max_num_batched_tokens": BUDGET,
        "max_num_seqs": MAX_NUM_SEQS,
        # Halved, the pool still holds the longest request alone (else the engine refuses it).
        "num_kv_blocks": max(pool, 2 * (longest + 1)),
        "block_size": BLOCK_SIZE,
    }


class _Prompts:
    """Random token ids (above the special tokens), chats starting with one system prompt, their
    lengths drawn from the mix's ranges (checked here, named by `what`)."""

    def __init__(self, what: str, mix: ChatMix) -> None:
        _check_range(f"{what} prompts", *mix.prompt_range)
        _check_range(f"{what} outputs", *mix.output_range)
        self.mix = mix
        self.rng, self.vocab_size = random.Random(mix.seed), mix.vocab_size
        self.system = self.ids(SYSTEM_TOKENS)

    def chats(self, count: int, system: bool = True) -> list[Chat]:
        """`count` chats, each starting with the system prompt when `system`."""
        prompt = self.chat if system else self.ids
        rng, mix = self.rng, self.mix
        return [
            Chat(prompt(rng.randint(*mix.prompt_range)), rng.randint(*mix.output_range))
            for _ in range(count)
        ]

    def ids(self, count: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab_size) for _ in range(count)]

    def chat(self, length: int) -> list[int]:
        if length <= SYSTEM_TOKENS + BLOCK_SIZE:  # too short to hold it and ask something
            return self.ids(length)
        return self.system + self.ids(length - SYSTEM_TOKENS)


def bursty_chat_plan(mix: ChatMix) -> Plan:
    """`num_chats` chats in bursts of a sixth to a half of them, 0.3-1.5 s apart; the pool
    holds the largest burst at its end, and a quarter more."""
    prompts, num_chats = _Prompts("bursty chat", mix), mix.num_chats
    rng = prompts.rng
    bursts: list[Burst] = []
    left = num_chats
    while left > 0:
        size = min(rng.randint(max(1, num_chats // 6), max(1, num_chats // 2)), left)
        chats = prompts.chats(size)
        bursts.append(Burst(rng.uniform(0.3, 1.5) if bursts else 0.0, chats))
        left -= size
    largest = max(sum(_blocks(c) for c in b.chats) for b in bursts)
    return Plan(
        "bursty_chat",
        f"bursty chat: {num_chats} chats in {len(bursts)} bursts, {mix.lengths}",
        bursts,
        _engine(bursts, largest * 5 // 4),
    )


def long_prompt_plan(mix: ChatMix, long_prompt: int) -> Plan:
    """`num_chats` short chats in three bursts 0.5 s apart; the middle burst (half of them) is
    led by one `long_prompt`-token prompt with the shortest output. The pool holds every
    request at once."""
    prompts, num_chats = _Prompts("short chat", mix), mix.num_chats
    if long_prompt <= mix.prompt_range[1]:
        raise ValueError(
            f"long_prompt ({long_prompt}) must be longer than the short chats' longest prompt "
            f"({mix.prompt_range[1]})"
        )
    chats = prompts.chats(num_chats)
    first, middle = num_chats // 4, num_chats // 4 + (num_chats + 1) // 2
    long = Chat(prompts.ids(long_prompt), mix.output_range[0])
    bursts = [
        Burst(0.0, chats[:first]),
        Burst(0.5, [long, *chats[first:middle]]),
        Burst(0.5, chats[middle:]),
    ]
    bursts = [b for b in bursts if b.chats]
    return Plan(
        "long_prompt",
        f"one long prompt among short chats: a {long_prompt}-token prompt leading the middle of "
        f"3 bursts of {num_chats} chats, {mix.lengths}",
        bursts,
        _engine(bursts, sum(_blocks(c) for b in bursts for c in b.chats) + 1),
    )


def small_pool_plan(mix: ChatMix) -> Plan:
    """`num_chats` chats at once, the pool half of what they grow to (at least twice the
    longest request): decoding runs out of blocks and preempts."""
    prompts, num_chats = _Prompts("small pool", mix), mix.num_chats
    bursts = [Burst(0.0, prompts.chats(num_chats, system=False))]
    return Plan(
        "small_pool",
        f"a KV pool small enough to preempt: {num_chats} chats at once, {mix.lengths}",
        bursts,
        _engine(bursts, sum(_blocks(c) for c in bursts[0].chats) // 2),
    )


def record(plan: Plan, model: str, trace_db: str) -> float:
    """Run `plan` through a fresh `LLM(model, **plan.engine)` that records `trace_db`: each
    burst one `generate` call after its pause. Returns the seconds it took."""
    from stepscope.engine.entrypoints.llm import LLM

    with LLM(model=model, trace_db=trace_db, **plan.engine) as llm:
        start = time.perf_counter()
        for burst in plan.bursts:
            time.sleep(burst.pause_s)
            params = [
                SamplingParams(**CHAT_SAMPLING, max_tokens=c.output_tokens, ignore_eos=True)
                for c in burst.chats
            ]
            llm.generate([c.prompt for c in burst.chats], params, use_tqdm=False)
        return time.perf_counter() - start


def warm_up(model: str) -> None:
    """One short untraced run first, so that the recording's first steps are not the
    process's first (weights loaded, kernels and their buffers set up)."""
    from stepscope.engine.entrypoints.llm import LLM

    with LLM(model=model, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_NUM_SEQS) as llm:
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 1000) for _ in range(n)] for n in (16, 100, 300, 40)]
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)


# ---- the hand-made timing workload -------------------------------------------------------------
SYSTEM_BLOCKS = SYSTEM_TOKENS // BLOCK_SIZE
# A server's config as the CPU tier sets it, the pool big enough to hold a few dozen chats.
ENGINE_CONFIG = {
    "model_config": {"model": "tiny-llama", "device": "cpu", "dtype": "float32",
                     "max_model_len": None},
    "cache_config": {"block_size": BLOCK_SIZE, "num_kv_blocks": 2048,
                     "enable_prefix_caching": True},
    "scheduler_config": {"max_num_batched_tokens": 512, "max_num_seqs": 64,
                         "enable_chunked_prefill": True, "async_scheduling": False},
    "parallel_config": {},
    "observability_config": {},
    "offline": False,
}  # fmt: skip


def _hashes(parent: str, count: int, salt: str) -> list[str]:
    out = []
    for i in range(count):
        parent = hashlib.sha256(f"{parent}/{salt}/{i}".encode()).hexdigest()[:32]
        out.append(parent)
    return out


def bursty_chat(num_requests: int = 1000, seed: int = 0) -> Workload:
    """`num_requests` chats in bursts of 20-60, 15-30 s apart, each burst within half a second
    (with plausible CPU step times the engine works through most of a burst before the next);
    prompts 16-1,000 tokens (the system prompt's blocks shared by every prompt long enough to
    hold them), outputs 16-256 tokens. Built as a served run's `Workload`, no model run."""
    rng = random.Random(seed)
    system = _hashes("system", SYSTEM_BLOCKS, "s")
    requests = []
    t = 0.0
    while len(requests) < num_requests:
        burst = min(rng.randint(20, 60), num_requests - len(requests))
        for _ in range(burst):
            i = len(requests)
            prompt = rng.randint(16, 1000)
            full = prompt // BLOCK_SIZE
            own = _hashes(system[-1], max(full - SYSTEM_BLOCKS, 0), f"r{i}")
            requests.append(
                RecordedRequest(
                    request_id=f"chat-{i}",
                    arrival_s=t + rng.uniform(0, 0.5),
                    before_engine_s=0.002,
                    after_engine_s=0.001,
                    input_tokens=prompt,
                    output_tokens=rng.randint(16, 256),
                    cached_tokens=0,
                    block_hashes=tuple((system + own)[:full]),
                    prompt_token_ids=None,
                    sampling={"temperature": 0.7, "max_tokens": 256},
                    operation="chat",
                    dp_rank=0,
                    ttft_s=None,
                    e2e_s=0.0,
                )
            )
        t += rng.uniform(15.0, 30.0)
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(tuple(requests), ENGINE_CONFIG, "serve", BLOCK_SIZE)
