"""Gemma 3: a tiny random checkpoint's greedy float32 tokens and prompt log-probabilities equal
to transformers' Gemma3ForCausalLM on every attention backend, under chunked prefill and
preemption; its config read in each form in the wild and what is not implemented refused; the
packaged Gemma 3 270M (slow tier) against transformers reading the same GGUF, its tokenizer
included."""

from __future__ import annotations

import pytest
import torch

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.models.config import FULL, SLIDING, ModelShape
from tests.engine.models.checkpoints import build_checkpoint, reference_tokens

WINDOW = 24  # the tiny checkpoint's sliding window
SHORT = (5, 11, 17)  # with 6 new tokens, every context stays within the window
LONG = (9, 40, 61)  # past it: the local layers see only the last 24 positions
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
BUDGET = 8  # tokens a step: every prompt is chunked


def _pool(folder, blocks_per_group: int) -> int:
    """A KV pool of `blocks_per_group` blocks in each KV cache group (five sliding-window groups
    and one full-attention group of one layer each here), and the null block."""
    from stepscope.engine.core.kv_cache_utils import kv_cache_groups_for, needs_null_block
    from stepscope.engine.models.config import read_model_shape

    groups = kv_cache_groups_for(read_model_shape(folder))
    return blocks_per_group * len(groups) + needs_null_block(groups)


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(31 * n + 7 * j) % 4000 + 100 for j in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), seed=3)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_greedy_tokens_equal_transformers_chunked_and_preempted(gemma3, backend):
    prompts = _prompts(SHORT)
    # 3 blocks of 16 tokens a group: the longest request (23 tokens) alone, not all three.
    llm = LLM(model=str(gemma3), attention_backend=backend, num_kv_blocks=_pool(gemma3, 3),
              max_num_batched_tokens=BUDGET)  # fmt: skip
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = reference_tokens(gemma3, prompts, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine_core.scheduler.step_index > NEW_TOKENS + max(SHORT) // BUDGET  # chunked


# Triton interpreted on a CPU takes 15 s over these prompts: slow tier.
SLOW_TRITON = pytest.param("triton", marks=pytest.mark.slow)


@pytest.mark.parametrize("backend", ["cpu", "torch", SLOW_TRITON])
def test_prompts_longer_than_the_window_equal_transformers(gemma3, backend):
    prompts = _prompts(LONG)
    # A full-attention table long enough for the longest (67 tokens).
    llm = LLM(model=str(gemma3), attention_backend=backend, num_kv_blocks=_pool(gemma3, 5),
              max_num_batched_tokens=BUDGET)  # fmt: skip
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = reference_tokens(gemma3, prompts, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == want


def test_tensor_parallel_2_gives_the_same_tokens(tmp_path):
    """Two KV heads, one a rank: the q/k norms on each rank's heads, the post-attention and
    post-MLP norms after the all-reduce."""
    folder = build_checkpoint("gemma3", tmp_path / "gemma3", seed=6, num_key_value_heads=2)
    prompts = _prompts(LONG)
    llm = LLM(model=str(folder), executor="mp", tensor_parallel_size=2,
              num_kv_blocks=_pool(folder, 6))  # fmt: skip
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    want = reference_tokens(folder, prompts, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == want


def test_a_multimodal_gemma3_folder_runs_its_text_model(gemma3, tmp_path):
    """A Gemma3ForConditionalGeneration folder (model_type gemma3, a text_config, the text
    weights under language_model., a vision tower beside them): its text model's tokens, as
    transformers generates them from the whole model."""
    import shutil

    import transformers

    from tests.engine.models.checkpoints import COMMON, GEMMA3

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(text_config={**COMMON, **GEMMA3[1]}, vision_config=vision,
                                       mm_tokens_per_image=4, initializer_range=0.2)  # fmt: skip
    torch.manual_seed(4)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path)
    for path in gemma3.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(path, tmp_path / path.name)
    prompts = _prompts(SHORT)
    with torch.inference_mode():
        want = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    llm = LLM(model=str(tmp_path), num_kv_blocks=_pool(tmp_path, 6))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want


def test_prompt_logprobs_equal_transformers_with_final_soft_capping(gemma3):
    """Soft-capping leaves the argmax alone; the log-probabilities show it is applied."""
    from transformers import AutoModelForCausalLM

    prompt = _prompts((20,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    llm = LLM(model=str(gemma3), num_kv_blocks=_pool(gemma3, 2))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ours = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)])
    model = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    assert logits.abs().max() < 30.0  # capped at final_logit_softcapping
    want = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert (ours - want).abs().max() < 1e-4


# ---- the config, read and refused --------------------------------------------------------------
GEMMA3 = dict(
    model_type="gemma3_text", vocab_size=10, hidden_size=64, intermediate_size=128,
    num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    sliding_window=16,
)  # fmt: skip


def test_layer_types_follow_the_sliding_window_pattern_of_older_configs():
    shape = ModelShape.from_hf_config({**GEMMA3, "sliding_window_pattern": 3})
    assert shape.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING)
    assert shape.sliding_window == 16 and shape.query_pre_attn_scalar == 256  # the default
    default = ModelShape.from_hf_config(GEMMA3).layer_types
    assert default == (SLIDING,) * 5 + (FULL, SLIDING)
    llama = ModelShape.from_hf_config({**GEMMA3, "model_type": "llama"})
    assert llama.layer_types == (FULL,) * 7 and llama.sliding_window is None


def test_rope_of_global_and_local_layers_from_either_config_form():
    old = ModelShape.from_hf_config(
        {**GEMMA3, "rope_theta": 5e5, "rope_local_base_freq": 500.0,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    )  # fmt: skip
    new = ModelShape.from_hf_config(
        {**GEMMA3, "rope_parameters": {
            FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
            SLIDING: {"rope_type": "default", "rope_theta": 500.0},
        }}
    )  # fmt: skip
    assert old == new
    assert (new.rope_theta, new.rope_local_theta, new.rope_scaling.factor) == (5e5, 500.0, 8.0)


def test_the_multimodal_wrapper_is_read_through_its_text_config():
    shape = ModelShape.from_hf_config({"model_type": "gemma3", "text_config": GEMMA3})
    assert shape == ModelShape.from_hf_config(GEMMA3)
    # Fields a text_config leaves out take Gemma3TextConfig's defaults.
    bare = ModelShape.from_hf_config({"model_type": "gemma3", "text_config": {}})
    assert (bare.num_layers, bare.hidden_size, bare.sliding_window) == (26, 2304, 4096)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"layer_types": [FULL] * 6}, "layer_types="),
        ({"layer_types": ["chunked_attention"] * 7}, "layer_types="),
        ({"sliding_window": None}, "sliding_window=None"),
        (
            {"rope_parameters": {SLIDING: {"rope_type": "linear", "factor": 2.0}}},
            "rope scaling of Gemma 3's sliding layers",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "type 'yarn'"),
    ],
)
def test_a_gemma3_field_that_changes_the_math_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config({**GEMMA3, **fields})


# ---- the packaged checkpoint -----------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma3_270m_reference():
    """transformers' own reading of the packaged GGUF: its tokenizer and its model (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stepscope.engine.models.loader import gemma3_gguf_path

    path = gemma3_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return tokenizer, model.eval()


@pytest.mark.slow  # transformers dequantizes the 253 MB GGUF (about a minute)
def test_gemma_3_270m_equals_transformers_on_the_same_gguf(gemma3_270m_reference):
    tokenizer, model = gemma3_270m_reference
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id  # <bos>, as transformers adds it
    with torch.inference_mode():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    # Dequantized; then through the GGUF's own blocks at every step (float32 activations: the
    # quantized path's accuracy measurement, docs/benchmarks.md, kept SmolLM2's greedy tokens).
    for quantization in (None, "gguf"):
        llm = LLM(model="gemma-3-270m", dtype="float32", quantization=quantization,
                  quantized_max_tokens=None, num_kv_blocks=64)  # fmt: skip
        out = llm.generate([text], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids  # a plain string tokenized as transformers does
        assert out.outputs[0].token_ids == want[0, len(ids) :].tolist(), quantization
        llm.shutdown()


@pytest.mark.slow  # the GGUF's 236 tensors dequantized once more (the fixture's model shared)
def test_gemma_3_270m_weights_equal_transformers_reading_of_the_gguf(gemma3_270m_reference):
    """Every tensor by transformers' name, the norms with llama.cpp's added 1 taken off: the
    dequantized weights and the repacked blocks' values equal transformers' exactly."""
    from stepscope.engine.layers.quantization import QuantizedWeight
    from stepscope.engine.models.gguf import load_gguf_weights
    from stepscope.engine.models.loader import resolve_model

    reference = gemma3_270m_reference[1].state_dict()
    reference.pop("lm_head.weight")  # tied to the embeddings
    folder = resolve_model("gemma-3-270m")
    dequantized = load_gguf_weights(folder, quantized=False)
    blocks = load_gguf_weights(folder, quantized=True)
    assert set(dequantized) == set(blocks) == set(reference)
    for name, want in reference.items():
        assert torch.equal(dequantized[name], want), name
        got = blocks[name]
        assert torch.equal(got.dequantize() if isinstance(got, QuantizedWeight) else got, want)
    assert isinstance(blocks["model.layers.0.mlp.down_proj.weight"], QuantizedWeight)


@pytest.mark.slow  # three 1,500-token prompts in float32 through both (about 2 minutes)
def test_gemma_3_270m_long_prompts_chunked_and_preempted_equal_transformers(
    gemma3_270m_reference,
):
    """Prompts three times the 512-token window, prefilled in 512-token chunks, in a pool that
    holds every group's table of one request at a time (the sliding groups giving back what
    their window left): transformers' greedy tokens, after preemptions."""
    from pathlib import Path

    tokenizer, model = gemma3_270m_reference
    ids = tokenizer.encode((Path(__file__).parents[3] / "docs" / "architecture.md").read_text())
    bos, n = ids[0], 1500
    prompts = [[bos, *ids[1 + start : start + n]] for start in (0, 1000, 2000)]
    with torch.inference_mode():
        want = [
            model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, n:].tolist()
            for p in prompts
        ]
    # Six groups (one of the three global layers, five of three local ones), 96 blocks each.
    llm = LLM(model="gemma-3-270m", dtype="float32", quantization=None,
              num_kv_blocks=6 * 96 + 1, max_num_batched_tokens=512)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    llm.shutdown()


@pytest.mark.slow  # transformers converts the GGUF's 262,144-token vocabulary (about 30 s)
def test_gemma_3_270m_tokenizes_as_transformers_reading_the_gguf(gemma3_270m_reference):
    from stepscope.engine.models.loader import load_tokenizer, resolve_model

    want = gemma3_270m_reference[0]
    ours = load_tokenizer(resolve_model("gemma-3-270m"))
    for text in ("Hello", "  two spaces, tabs\tand\nnewlines", "Ünïcödé 数字 123 🙂", "<bos>x"):
        assert ours.encode(text) == want.encode(text), text
    assert ours.decode(want.encode("Paris, France")) == want.decode(want.encode("Paris, France"))


def test_chat_with_a_checkpoint_without_a_chat_template_is_refused_as_bad_input():
    """Gemma 3 270M's GGUF (a base model) ships no chat template: a chat request is the
    caller's error (HTTP 400), not the server's."""
    from types import SimpleNamespace

    from stepscope.engine.frontend.input_processor import InputProcessor
    from stepscope.engine.sampling_params import FieldError

    processor = InputProcessor(SimpleNamespace(eos_token_id=1, chat_template=None), 64, 10)
    with pytest.raises(FieldError, match="has no chat template: send a plain prompt"):
        processor.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bfloat16_logprobs_agree_with_transformers_bfloat16(gemma3):
    """The torch backend computes bfloat16 op for op as transformers does (the norms' float32
    products, the embedding scale rounded to bfloat16): the same log-probabilities. The cpu
    backend's kernels round elsewhere (0.19 nats here), less than bfloat16 itself moves
    transformers from float32 (0.43)."""
    from transformers import AutoModelForCausalLM

    prompt = _prompts((20,))[0]
    targets = torch.tensor(prompt[1:])[:, None]
    want = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(gemma3, dtype=dtype).eval()
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        want[dtype] = logits.log_softmax(-1).gather(1, targets)[:, 0]
    bf16_error = (want[torch.bfloat16] - want[torch.float32]).abs().max()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for backend in ("torch", "cpu"):
        llm = LLM(model=str(gemma3), dtype="bfloat16", attention_backend=backend,
                  num_kv_blocks=_pool(gemma3, 2))  # fmt: skip
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        lps = zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
        gap = (torch.tensor([d[t] for d, t in lps]) - want[torch.bfloat16]).abs().max()
        assert gap == 0 if backend == "torch" else gap < bf16_error, (backend, gap)


@pytest.mark.slow  # starts `stepscope serve` on the packaged checkpoint (about 15 s)
def test_serve_gemma_3_270m_completes_and_refuses_chat():
    """The named model served as it comes (its GGUF blocks, the dtype "auto" picks): a plain
    completion, the prompt counted with <bos>; a chat request is the caller's 400, the
    checkpoint having no chat template."""
    import httpx

    from tests.server_utils import served

    with served("--model", "gemma-3-270m", "--num-kv-blocks", "256", "--no-trace") as server:
        [model] = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        body = {"model": "gemma-3-270m", "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        completion = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        chat = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}]}
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert model["quantization"] == "gguf" and "Q4_K" in model["weight_format"]
    assert completion["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    assert completion["choices"][0]["text"].startswith(" the capital")
    assert refused.status_code == 400 and "no chat template" in refused.text
