"""`AsyncLLM` on tiny-llama in its own engine-core process: n > 1 fans out inside it, and bad
input is refused by the call to `generate`, before anything reaches the engine."""

from __future__ import annotations

import asyncio

import pytest

from stepscope.engine.frontend.async_llm import AsyncLLM
from stepscope.engine.sampling_params import FieldError, SamplingParams

PROMPT = "Once upon a time"


async def sequences(engine: AsyncLLM, params: SamplingParams, request_id: str) -> list[list[int]]:
    """Each sequence's token ids, rebuilt from the increments by their index."""
    tokens: dict[int, list[int]] = {}
    finished = []
    async for out in engine.generate(PROMPT, params, request_id):
        assert out.request_id == request_id
        indexes = [c.index for c in out.outputs]
        assert indexes == sorted(set(indexes))  # each sequence at most once, in index order
        assert len(out.children_metrics) == len(out.outputs)
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
        finished.append(out.finished)
    assert finished[-1] and not any(finished[:-1])  # finished once, when every sequence has
    return [tokens[i] for i in sorted(tokens)]


def test_generate_with_n_3_yields_three_sequences_that_differ_and_repeat_with_a_seed() -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)

    async def run() -> None:
        engine = AsyncLLM("tiny-llama", executor="uni", num_kv_blocks=64)
        try:
            first = await sequences(engine, params, "a")
            again = await sequences(engine, params, "b")
            assert len(first) == 3 and all(len(s) == 8 for s in first)
            assert len({tuple(s) for s in first}) == 3  # child i samples with seed + i
            assert again == first  # and reproducibly
            with pytest.raises(FieldError) as info:
                engine.generate(PROMPT, SamplingParams(max_tokens=10**6), "too-long")
            assert info.value.param == "max_tokens"
            stats = await engine.get_stats()
            assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        finally:
            engine.shutdown()

    asyncio.run(run())
