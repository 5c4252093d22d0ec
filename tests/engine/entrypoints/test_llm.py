"""The offline `LLM` API on tiny-llama: outputs, sampling, stops, metrics and validation."""

from __future__ import annotations

import pytest
import torch

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.config import EngineConfig
from stepscope.engine.layers.attention import resolve_attention_backend
from stepscope.kernels.cpu.build import available as cpu_kernel_available

PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
    "Once upon a time, in a land far away, there lived a",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-llama", num_kv_blocks=128, max_num_batched_tokens=64)


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_outputs_come_back_in_input_order_with_prompt_and_ids(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for o in outputs:
        assert o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt)


def test_greedy_tokens_do_not_depend_on_the_rest_of_the_batch(llm: LLM) -> None:
    batch = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    alone = [llm.generate(p, greedy(), use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]


def test_token_id_prompts_are_accepted(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[0])
    by_ids = llm.generate(ids, greedy(), use_tqdm=False)[0]
    by_text = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0]
    assert by_ids.prompt is None and by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_same_seed_gives_same_tokens_whatever_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=10)
    alone = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10)
    batch = llm.generate(PROMPTS, [others, params, others, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8, max_tokens=10)
    assert llm.generate(PROMPTS[1], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=8))
    exact = llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in exact]


def test_logprobs_hold_the_sampled_token_and_top_n(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], greedy(5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert token in lp and 1 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())
        assert lp[token] == pytest.approx(max(lp.values()))  # greedy picks the top-1


def test_n_returns_that_many_completions(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    ref = llm.generate(PROMPTS[2], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = ref[4]
    first = ref.index(stop_at)
    out = llm.generate(PROMPTS[2], greedy(12, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert (
        c.token_ids == ref[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_at
    )
    later = llm.generate(
        PROMPTS[2], greedy(12, stop_token_ids=[stop_at], min_tokens=first + 2), use_tqdm=False
    )[0].outputs[0]
    assert len(later.token_ids) > first + 1


def test_stop_string_truncates_the_text_and_frees_the_request(llm: LLM) -> None:
    ref = llm.generate(PROMPTS[3], greedy(16), use_tqdm=False)[0].outputs[0]
    stop = ref.text[len(ref.text) // 2 :][:3]
    assert stop.strip(), ref.text
    cut = ref.text.index(stop)
    out = llm.generate(PROMPTS[3], greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == ref.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        PROMPTS[3], greedy(16, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == ref.text[: cut + len(stop)]
    core = llm.engine_core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def test_chat_applies_the_chat_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Hi!"}], greedy(4), use_tqdm=False)[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert "<|im_start|>user\nHi!<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_metrics_are_ordered_and_every_block_is_free_after(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for o in outputs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.queue_time >= 0 and m.ttft > 0
    core = llm.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def test_prompt_longer_than_the_context_is_refused_and_loses_nothing() -> None:
    small = LLM(model="tiny-llama", num_kv_blocks=64, max_model_len=32)
    with pytest.raises(ValueError, match="context is 32 tokens"):
        small.generate(["hi", "word " * 40], greedy(), use_tqdm=False)
    assert not small.engine_core.has_unfinished_requests()
    out = small.generate("hi", greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    # A max_tokens the context cannot hold is refused too, saying what would fit...
    with pytest.raises(ValueError, match=r"exceeds the context of 32 tokens; ask for at most 11"):
        small.generate("word " * 20, greedy(100), use_tqdm=False)
    assert not small.engine_core.has_unfinished_requests()
    # ...while max_tokens=None generates until the context is full.
    capped = small.generate("word " * 20, greedy(None), use_tqdm=False)[0]
    total = len(capped.prompt_token_ids) + len(capped.outputs[0].token_ids)
    assert total == 32 and capped.outputs[0].finish_reason == "length"
    # A stop string longer than the context could never match: refused, naming the context.
    with pytest.raises(ValueError, match=r"stop string 1 is \d+ tokens long.*context of 32 tokens"):
        small.generate("hi", greedy(4, stop=["x", "word " * 40]), use_tqdm=False)
    assert not small.engine_core.has_unfinished_requests()
    assert small.generate("hi", greedy(4, stop=["word" * 8]), use_tqdm=False)[0].finished


def test_a_kv_pool_smaller_than_the_context_lowers_max_model_len_or_is_refused() -> None:
    # 4 blocks of 16 hold 64 tokens; tiny-llama's own context is 4096 positions.
    llm = LLM(model="tiny-llama", num_kv_blocks=4, block_size=16)
    assert llm.engine_core.max_model_len == 64
    # The prompt that used to hang the engine for good is refused at the edge, at once...
    with pytest.raises(ValueError, match="the model's context is 64 tokens"):
        llm.generate([list(range(100, 300))], greedy(4), use_tqdm=False)
    # ...and a request that decodes until the pool is full finishes instead of preempting
    # itself forever.
    out = llm.generate("hello", greedy(None), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert out.outputs[0].finish_reason == "length"
    # A context asked for explicitly that the pool cannot hold fails start-up with the numbers.
    with pytest.raises(ValueError, match=r"4 blocks of 16 tokens hold 64 tokens.*at least 7"):
        LLM(model="tiny-llama", num_kv_blocks=4, block_size=16, max_model_len=100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"n": 0}, "n must be between"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 99}, "logprobs must be between"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"presence_penalty": 50}, r"presence_penalty must be in \[-2, 2\], got 50"),
        ({"presence_penalty": -2.5}, r"presence_penalty must be in \[-2, 2\], got -2.5"),
        ({"frequency_penalty": 2.01}, r"frequency_penalty must be in \[-2, 2\], got 2.01"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be a finite number"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ],
)
def test_bad_sampling_params_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 10}, "block_size must be a multiple of 16, got 10"),
        ({"dtype": "float64"}, "dtype must be one of 'auto'"),
        ({"device": "tpu"}, "device must be"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be positive"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be at least 1"),
        ({"attention_backend": "flash"}, "attention_backend must be"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
    ],
)
def test_bad_engine_config_fails_with_an_actionable_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(**kwargs)


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        LLM(model="no-such-model")


def test_cpu_defaults_follow_the_documented_tier() -> None:
    offline = EngineConfig.create()
    server = EngineConfig.create(offline=False).scheduler_config
    cache, sched = offline.cache_config, offline.scheduler_config
    assert (cache.block_size, cache.enable_prefix_caching) == (16, True)
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (1024, 128)
    assert (server.max_num_batched_tokens, server.max_num_seqs) == (512, 64)
    # The worker picks the backend: the C kernels' where a C compiler builds them, else the
    # torch reference.
    assert offline.model_config.attention_backend is None
    expected = "cpu" if cpu_kernel_available() is None else "torch"
    assert resolve_attention_backend(None, torch.device("cpu")) == expected


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_backend_gives_the_same_greedy_tokens_as_torch(block_size: int) -> None:
    # A 24-token budget forces prefill chunks and decodes to share kernel launches.
    prompts = PROMPTS[:3]
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model="tiny-llama",
            num_kv_blocks=64,
            block_size=block_size,
            max_num_batched_tokens=24,
            attention_backend=backend,
        )
        outs = llm.generate(prompts, greedy(10), use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["triton"] == tokens["torch"]


def test_without_chunked_prefill_a_budget_below_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="every prompt must fit in one step"):
        LLM(model="tiny-llama", num_kv_blocks=16, enable_chunked_prefill=False,
            max_num_batched_tokens=64)  # fmt: skip
