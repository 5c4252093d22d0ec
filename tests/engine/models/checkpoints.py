"""Tiny random checkpoints of each supported family, built with transformers' own config and
model classes (no hub) and saved as a user's folder would be: config.json, safetensors weights
(sharded with an index where asked), generation_config.json and the SmolLM2 tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from stepscope.engine.models.loader import resolve_model

VOCAB = 49152  # the SmolLM2 tokenizer's
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.2,  # peaked logits: greedy choices are not near ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# Each family's own parts, and the shapes that exercise them.
FAMILIES = {
    # Llama 3: rope scaling of type llama3, an untied head, one KV head for four query heads,
    # head_dim 32 where hidden / heads is 16. The older config form (rope_scaling + rope_theta).
    "llama3": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
            rope_theta=500000.0,
        ),
    ),
    # Qwen2: q/k/v biases, tied embeddings, two KV heads.
    "qwen2": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim 32 (hidden / heads is 16), an untied head.
    "qwen3": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    ),
}
# Gemma 3: six layers, the sixth global (the default pattern), the others in a window of 24
# positions; one KV head for two query heads of 32 (hidden / heads is also 32: the attention
# scale comes from query_pre_attn_scalar, 20); global rope scaled (linear), local rope with its
# own base; the final logits soft-capped.
GEMMA3 = (
    "Gemma3TextConfig",
    dict(
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=20,
        sliding_window=24,
        rms_norm_eps=1e-6,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=100000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=1000.0),
        },
    ),
)
ALL_FAMILIES = {**FAMILIES, "gemma3": GEMMA3}


def build_checkpoint(
    family: str, out: Path, seed: int = 0, shard: bool = False, **overrides
) -> Path:
    """Save a tiny random `family` checkpoint into `out`, its config's fields changed by
    `overrides`; `shard` splits its weights over several safetensors files with an index, as
    transformers saves large models."""
    import transformers

    config_class, fields = ALL_FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # transformers zeroes biases and sets norms to one: randomize them
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out, max_shard_size="1MB" if shard else "1GB")
    tokenizer_dir = resolve_model("smollm2-135m-instruct")
    for path in tokenizer_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(path, out / path.name)
    return out


def update_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(fields)
    path.write_text(json.dumps(data, indent=2))


def reference_tokens(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` in float32, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)
            out.append(ids[0, len(p) :].tolist())
    return out
