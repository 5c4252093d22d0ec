"""A hand-made workload for the what-if tests: the bursty chat mix of issue 40's speed target
(prompts 16-1,000 tokens, outputs 16-256, requests in bursts), built as a `Workload` with no
model run, and a cost model of plausible CPU step times to time it with."""

from __future__ import annotations

import hashlib
import random

from stepscope.traces.backend.workload import RecordedRequest, Workload
from stepscope.viz.cost_model import CostModel

BLOCK_SIZE = 16
SYSTEM_BLOCKS = 4  # every chat starts with the same 64-token system prompt
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
# About a 135M model's steps on a few CPU cores: a 64-chat decode step ~80 ms, a 512-token
# prefill chunk ~220 ms.
COST = CostModel(
    fixed_s=0.015,
    prefill_token_s=0.0004,
    decode_token_s=0.001,
    context_token_s=1e-6,
    gap_s=0.001,
    wake_s=0.001,
)


def _hashes(parent: str, count: int, salt: str) -> list[str]:
    out = []
    for i in range(count):
        parent = hashlib.sha256(f"{parent}/{salt}/{i}".encode()).hexdigest()[:32]
        out.append(parent)
    return out


def bursty_chat(num_requests: int = 1000, seed: int = 0) -> Workload:
    """`num_requests` chats in bursts of 20-60, 15-30 s apart, each burst within half a second
    (with `COST`, the engine works through most of a burst before the next); prompts 16-1,000 tokens (the system prompt's blocks shared by every prompt long
    enough to hold them), outputs 16-256 tokens."""
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
