"""The hybrid KV cache end to end on a tiny random Gemma 3 (five sliding-window layers of 24
positions, one global): one block table per group, the worker's tensor pairs shared across
groups, the sliding groups' tables freed behind the window, and greedy float32 tokens equal to
transformers' with the hybrid manager on and off, chunked and preempted (issue 39)."""

from __future__ import annotations

import inspect

import pytest

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.layers.attention import TorchAttentionBackend
from tests.engine.models.checkpoints import build_checkpoint, reference_tokens

LONG = (9, 40, 61)  # past the window of 24: the local layers see only their last 24 positions
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# Six groups of one layer: a block is one layer's 16 tokens. 31 blocks (one the null block)
# hold 5 blocks per group, 80 tokens: the 67-token request alone, not all three at once. Off,
# a block is all six layers' 16 tokens: 6 of them hold as many bytes as 36 hybrid blocks.
HYBRID_POOL = dict(num_kv_blocks=31, max_num_batched_tokens=8)
SINGLE_POOL = dict(num_kv_blocks=6, max_num_batched_tokens=8)

pytestmark = pytest.mark.skipif(
    "sliding_window" not in inspect.signature(TorchAttentionBackend.forward).parameters,
    reason="the attention backends take no sliding_window yet (issue 39, item 3)",
)


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(31 * n + 7 * j) % 4000 + 100 for j in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), seed=3)


@pytest.fixture(scope="module")
def want(gemma3):
    return reference_tokens(gemma3, _prompts(LONG), NEW_TOKENS)


def _record_blocks_by_group(llm: LLM) -> list[tuple[int, ...]]:
    """Every step's blocks held per group, as the scheduler reports them."""
    scheduler = llm.engine_core.scheduler
    schedule, seen = scheduler.schedule, []

    def recording():
        out = schedule()
        seen.append(scheduler.last_stats.kv_blocks_by_group)
        return out

    scheduler.schedule = recording
    return seen


@pytest.mark.parametrize(
    "backend", ["cpu", "torch", pytest.param("triton", marks=pytest.mark.slow)]
)  # triton interpreted on a CPU: 18 s
def test_hybrid_tables_free_the_window_and_keep_the_tokens(gemma3, want, backend):
    llm = LLM(model=str(gemma3), attention_backend=backend, **HYBRID_POOL)
    runner = llm.engine_core.executor.worker.model_runner
    assert llm.engine_core.kv_cache_manager.num_groups == 6
    assert len({id(pair) for pair in runner.kv_caches}) == 1  # groups of one layer: one pair
    seen = _record_blocks_by_group(llm)

    outputs = llm.generate(_prompts(LONG), GREEDY, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    # Group 0 is the global layer; a sliding group held fewer blocks once past the window.
    assert any(max(held[1:]) < held[0] for held in seen)
    assert seen[-1] and all(len(held) == 6 for held in seen)


def test_hybrid_manager_switched_off_keeps_one_table_and_the_tokens(gemma3, want):
    llm = LLM(
        model=str(gemma3), attention_backend="torch", disable_hybrid_kv_cache_manager=True,
        **SINGLE_POOL,
    )  # fmt: skip
    runner = llm.engine_core.executor.worker.model_runner
    assert llm.engine_core.kv_cache_manager.num_groups == 1
    assert len({id(pair) for pair in runner.kv_caches}) == 6
    assert runner.kv_block_bytes() == 6 * 2 * 16 * 1 * 32 * 4  # six layers, k and v, float32

    outputs = llm.generate(_prompts(LONG), GREEDY, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in outputs] == want
