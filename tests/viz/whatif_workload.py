"""A hand-made workload for the what-if tests: the bursty chat mix of issue 40's speed target
(prompts 16-1,000 tokens, outputs 16-256, requests in bursts), built as a `Workload` with no
model run (engine/bench/whatif_workloads.py, which `bench whatif` times its grid on), and a cost
model of plausible CPU step times to time it with."""

from __future__ import annotations

from stepscope.engine.bench.whatif_workloads import BLOCK_SIZE, ENGINE_CONFIG, bursty_chat
from stepscope.viz.cost_model import CostModel

__all__ = ["BLOCK_SIZE", "COST", "ENGINE_CONFIG", "bursty_chat"]

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
