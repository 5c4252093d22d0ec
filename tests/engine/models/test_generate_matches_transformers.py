"""Greedy float32 tokens of the engine equal transformers `generate` on smollm2-135m-instruct:
in one batch, under chunked prefill, under preemption, and on prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.models.loader import resolve_model

pytestmark = pytest.mark.slow  # SmolLM2 in transformers and in the engine, four times

MAX_TOKENS = 32
MIN_REFERENCE_TOKENS = 24

LONG_TEXT = " ".join(
    f"Chapter {i}: the river town kept its ledgers in ink, and every merchant who crossed the "
    f"bridge paid {i * 3} coins to the keeper, who wrote the names in a careful hand."
    for i in range(1, 21)
)
PLAIN_PROMPTS = [
    "The history of the Roman Empire began",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Les montagnes de Suisse sont",
    "東京は日本の首都で、",
    LONG_TEXT,
]
CHATS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Explain photosynthesis to a child. 🌱"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Describe, step by step, how to bake bread at home."},
    ],
]


@pytest.fixture(scope="module")
def prompts_and_references() -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.encode(p) for p in PLAIN_PROMPTS]
    for chat in CHATS:
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    references = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)
            references.append(out[0, len(p) :].tolist())
    return prompts, references


def test_prompts_cover_the_required_range(prompts_and_references) -> None:
    prompts, references = prompts_and_references
    assert len(prompts) >= 8
    assert min(map(len, prompts)) <= 10 and 600 <= max(map(len, prompts)) <= 800
    assert all(len(r) >= MIN_REFERENCE_TOKENS for r in references), [len(r) for r in references]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="one-batch"),
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-prefill-32"),
        pytest.param({"block_size": 32, "max_num_batched_tokens": 100}, id="block32"),
    ],
)
def test_greedy_tokens_equal_transformers(prompts_and_references, engine_args) -> None:
    prompts, references = prompts_and_references
    llm = LLM(num_kv_blocks=512, dtype="float32", quantization=None, **engine_args)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references
    if "max_num_batched_tokens" in engine_args:
        assert llm.engine_core.scheduler.step_index > max(map(len, prompts)) // 100


def test_greedy_tokens_equal_transformers_under_preemption(prompts_and_references) -> None:
    prompts, references = prompts_and_references
    # 60 blocks of 16 tokens: enough for the longest request alone, far too few for all at once.
    llm = LLM(num_kv_blocks=60, dtype="float32", quantization=None)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine_core.kv_cache_manager.num_free_blocks == 60


def test_greedy_tokens_equal_transformers_on_prefix_cache_hits(prompts_and_references) -> None:
    prompts, references = prompts_and_references
    llm = LLM(num_kv_blocks=512, dtype="float32", quantization=None)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == references
    for before, after in zip(first, second, strict=True):
        # Every full block of the prompt but the one holding its last token is a hit.
        expected = (len(after.prompt_token_ids) - 1) // 16 * 16
        assert after.metrics.num_cached_tokens == expected
        assert after.metrics.num_cached_tokens >= before.metrics.num_cached_tokens
