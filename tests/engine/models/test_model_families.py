"""Llama 3, Qwen2 and Qwen3 checkpoints from a local folder: greedy float32 tokens equal to
transformers' `generate` under chunked prefill and preemption on every attention backend, at
TP=2, bfloat16 logits within a stated tolerance, and each unsupported config field refused."""

from __future__ import annotations

import pytest
import torch

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.layers.rotary import RopeScaling, rope_inv_freq
from stepscope.engine.models.config import ModelShape
from tests.engine.models.checkpoints import FAMILIES, build_checkpoint, reference_tokens

PROMPT_LENS = (5, 23, 41)  # with a 16-token budget the longer ones take several chunks
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# 5 blocks of 16 tokens: room for the longest request alone (41 + 8 tokens: 4 blocks), not for
# all three (7 blocks).
SMALL_POOL = dict(num_kv_blocks=5, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple]:
    """family -> (folder, prompts, transformers' greedy tokens)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = build_checkpoint(
            family, tmp_path_factory.mktemp(family), seed=i, shard=family == "qwen3"
        )
        prompts = [[(97 * i + 31 * n + 7 * j) % 4000 + 100 for j in range(n)] for n in PROMPT_LENS]
        out[family] = (folder, prompts, reference_tokens(folder, prompts, NEW_TOKENS))
    return out


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers_chunked_and_preempted(checkpoints, family, backend):
    folder, prompts, references = checkpoints[family]
    llm = LLM(model=str(folder), attention_backend=backend, **SMALL_POOL)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine_core.scheduler.step_index > len(prompts) * NEW_TOKENS // 2  # chunked


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tensor_parallel_2_gives_the_same_tokens(checkpoints, family):
    folder, prompts, references = checkpoints[family]
    llm = LLM(model=str(folder), executor="mp", tensor_parallel_size=2, num_kv_blocks=32)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == references


def test_tensor_parallel_that_does_not_divide_the_kv_heads_is_refused(checkpoints):
    folder = checkpoints["llama3"][0]  # one KV head
    with pytest.raises(ValueError, match="must divide the model's 4 query heads and 1 KV heads"):
        LLM(model=str(folder), executor="mp", tensor_parallel_size=2)


# bfloat16 keeps 8 bits of mantissa. Measured on these models, the largest gap between the
# engine's and transformers' bfloat16 prompt log-probabilities: 0 for llama3 and qwen3 (the same
# roundings, op for op), 0.06 nats for qwen2 (its q/k/v bias is added after the matmul's
# rounding, transformers adds it inside), where bfloat16 itself is 0.08-0.10 from float32.
BF16_TOLERANCE = 0.1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_logprobs_agree_with_transformers_bfloat16(checkpoints, family):
    from transformers import AutoModelForCausalLM

    folder, prompts, _ = checkpoints[family]
    prompt = prompts[2]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = LLM(model=str(folder), dtype="bfloat16", num_kv_blocks=16).generate(
        [prompt], params, use_tqdm=False
    )[0]
    ours = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)])
    want = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        lp = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        want[dtype] = lp
    assert (ours - want[torch.bfloat16]).abs().max() <= BF16_TOLERANCE
    assert (want[torch.bfloat16] - want[torch.float32]).abs().max() > 0  # bfloat16 is lossy


# ---- the config, read and refused --------------------------------------------------------------
LLAMA = dict(
    model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=4,
)  # fmt: skip
LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)  # fmt: skip


def test_llama3_rope_reads_the_same_from_either_config_form():
    new = ModelShape.from_hf_config(
        {**LLAMA, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_SCALING}}
    )
    old = ModelShape.from_hf_config(
        {**LLAMA, "rope_scaling": {**LLAMA3_SCALING}, "rope_theta": 500000.0}
    )
    assert new == old and new.rope_theta == 500000.0 and new.rope_scaling.factor == 8.0
    assert not torch.equal(
        rope_inv_freq(16, 500000.0, new.rope_scaling), rope_inv_freq(16, 500000.0, RopeScaling())
    )


def test_rope_frequencies_equal_transformers_for_each_scaling():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for scaling in (
        dict(rope_type="linear", factor=4.0),
        dict(rope_type="dynamic", factor=2.0),
        dict(LLAMA3_SCALING, original_max_position_embeddings=512),
    ):
        hf = LlamaConfig(
            hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
            rope_parameters={"rope_theta": 10000.0, **scaling},
        )  # fmt: skip
        want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
        shape = ModelShape.from_hf_config(hf.to_dict())
        got = rope_inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling)
        assert torch.allclose(got, want, rtol=1e-6, atol=0), scaling["rope_type"]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported: stepscope runs llama"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "type 'yarn' is not supported"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True"),
        ({"model_type": "qwen3", "layer_types": ["sliding_attention"]}, "layer_types="),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
    ],
)
def test_a_config_field_that_changes_the_math_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config({**LLAMA, **fields})


def test_an_unsupported_checkpoint_is_refused_before_any_process_starts(tmp_path, checkpoints):
    import shutil

    folder = tmp_path / "mistral"
    shutil.copytree(checkpoints["qwen2"][0], folder)
    config = (folder / "config.json").read_text().replace('"qwen2"', '"mistral"')
    (folder / "config.json").write_text(config)
    with pytest.raises(ValueError, match="mistral' is not supported: stepscope runs llama, qwen2"):
        LLM(model=str(folder), executor="mp")


# ---- a served folder, with its own chat template and generation defaults ------------------------
TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


@pytest.mark.slow  # starts `stepscope serve` (8 s): the fast tier stays under 4 minutes
def test_serve_uses_the_folders_chat_template_generation_defaults_and_eos_list(tmp_path):
    """A tiny Qwen3 folder whose generation_config.json lists a second eos id (a token its greedy
    answer reaches) and top_k=1: a chat completion that sets no sampling values is greedy, is
    built with the folder's template, and stops at that eos id."""
    import openai
    from transformers import AutoTokenizer

    from tests.engine.models.checkpoints import update_json
    from tests.server_utils import Server

    folder = build_checkpoint("qwen3", tmp_path / "qwen3", seed=5)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    messages = [{"role": "user", "content": "Name three rivers."}]
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<<user>> Name three rivers.")
    prompt = tok.encode(text, add_special_tokens=False)
    greedy = reference_tokens(folder, [prompt], 8)[0]
    # The first token that did not come before it: stopping there is unambiguous.
    k = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i] and greedy[i] != 2)
    update_json(folder / "generation_config.json", eos_token_id=[2, greedy[k]], top_k=1,
                temperature=0.7)  # fmt: skip

    server = Server("--model", str(folder), "--served-model-name", "tiny-qwen3",
                    "--num-kv-blocks", "32", "--no-trace")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        [model] = client.models.list().data
        assert model.id == "tiny-qwen3"
        reply = client.chat.completions.create(model="tiny-qwen3", messages=messages, max_tokens=8)
    finally:
        server.stop()
    assert reply.usage.prompt_tokens == len(prompt)  # the folder's template, not SmolLM2's
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == k + 1  # the tokens up to the listed eos id
    assert reply.choices[0].message.content == tok.decode(greedy[:k], skip_special_tokens=True)


def test_llm_defaults_come_from_generation_config(checkpoints):
    folder = checkpoints["qwen2"][0]
    from tests.engine.models.checkpoints import update_json

    update_json(folder / "generation_config.json", temperature=0.6, top_p=0.9, top_k=20,
                repetition_penalty=1.1)  # fmt: skip
    try:
        llm = LLM(model=str(folder), num_kv_blocks=16)
        params = llm.get_default_sampling_params()
    finally:
        update_json(folder / "generation_config.json", temperature=None, top_p=None, top_k=None,
                    repetition_penalty=None)  # fmt: skip
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        0.6, 0.9, 20, 1.1,
    )  # fmt: skip
