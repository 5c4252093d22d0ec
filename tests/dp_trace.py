"""A real data-parallel run's trace, recorded once per test module that needs it."""

from __future__ import annotations

from pathlib import Path

PROMPTS = [f"Prompt {i}: tell me about scheduling " * (1 + i % 3) for i in range(8)]
MAX_TOKENS = 8


def record_dp2_trace(path: Path) -> Path:
    """tiny-llama with data_parallel_size=2 (in-process executor in each engine core), PROMPTS
    greedy to MAX_TOKENS each, its spans in `path`."""
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.sampling_params import SamplingParams

    llm = LLM(
        model="tiny-llama",
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        data_parallel_size=2,
        executor="uni",
        trace_db=path,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return path
