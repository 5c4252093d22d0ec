"""A checkpoint's config.json, read into the shape the decoder runs (worker; the API process
reads it too, to refuse a checkpoint before anything starts).

Llama and Qwen share one decoder (engine/models/llama.py), and Gemma 3 its layout of weights.
What differs is small, and each difference is a field here:

| family  | model_type  | q/k/v bias | per-head q/k RMSNorm | vLLM's file                          |
|---------|-------------|------------|----------------------|--------------------------------------|
| Llama   | llama       | no         | no                   | vllm/model_executor/models/llama.py  |
| Qwen2   | qwen2       | yes        | no                   | vllm/model_executor/models/qwen2.py  |
| Qwen3   | qwen3       | no         | yes                  | vllm/model_executor/models/qwen3.py  |
| Gemma 3 | gemma3_text | no         | yes                  | vllm/model_executor/models/gemma3.py |

All of them may have an untied `lm_head`, a `head_dim` other than hidden / heads, fewer KV heads
than query heads (grouped-query attention), and rope scaling (engine/layers/rotary.py).

Gemma 3 (engine/models/gemma3.py) adds more than a field: norms of the form x * (1 + weight)
before and after both sub-layers, GeGLU, a scale of `query_pre_attn_scalar`**-0.5, and a
pattern of local layers (a sliding window, their own rope base, never scaled) and global ones
(full attention, `rope_theta` and the rope scaling). `gemma3` configs (the multimodal wrapper)
are read through their `text_config`. Every layer's type is in `layer_types`; Llama's and
Qwen's are all "full_attention".

A config field that would change the math and that this decoder does not implement is refused
here with its name: never wrong tokens in silence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stepscope.engine.layers.rotary import ROPE_TYPES, RopeScaling

# model_type -> (q/k/v projections have a bias, q and k get a per-head RMSNorm)
FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "gemma3_text": (False, True),
}
SUPPORTED_MODEL_TYPES = (*FAMILIES, "gemma3")
FULL, SLIDING = "full_attention", "sliding_attention"

# Gemma3TextConfig's defaults (transformers): older config.json files, the hub's among them,
# hold only the fields that differ from these.
GEMMA3_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    max_position_embeddings=131_072, tie_word_embeddings=True, query_pre_attn_scalar=256,
    sliding_window=4096, hidden_activation="gelu_pytorch_tanh",
)  # fmt: skip
GEMMA3_ROPE_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclass(frozen=True, slots=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = RopeScaling()
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Gemma 3
    # Per layer, "full_attention" or "sliding_attention"; () means all full (filled in below).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # a query at p attends to keys p - W + 1 .. p
    # Gemma 3 only (None elsewhere):
    query_pre_attn_scalar: float | None = None  # the attention scale is this ** -0.5
    rope_local_theta: float | None = None  # the sliding layers' rope base (never scaled)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)

    @property
    def is_gemma3(self) -> bool:
        return self.model_type == "gemma3_text"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        """The shape of a config.json's contents; ValueError names what is not supported."""
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3":  # the multimodal wrapper: its text model
            cfg, model_type = gemma3_text_config(cfg), "gemma3_text"
        if model_type not in FAMILIES:
            raise ValueError(
                f"model_type {model_type!r} is not supported: stepscope runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        if model_type == "gemma3_text":
            return _gemma3_shape({**GEMMA3_DEFAULTS, **cfg})
        _refuse_unimplemented(cfg, model_type)
        theta, scaling = _rope(cfg)
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(
                f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})"
            )
        qkv_bias, qk_norm = FAMILIES[model_type]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
        )


def read_model_shape(model_dir: Path, tensor_parallel_size: int = 1) -> ModelShape:
    """The checkpoint's shape, or a ValueError naming the folder and what it refuses; also
    refused: a tensor-parallel size that does not divide the query and KV heads."""
    from stepscope.engine.models.loader import load_config

    try:
        shape = ModelShape.from_hf_config(load_config(model_dir))
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    if shape.num_heads % tensor_parallel_size or shape.num_kv_heads % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} must divide the model's "
            f"{shape.num_heads} query heads and {shape.num_kv_heads} KV heads"
        )
    return shape


def _refuse(cfg: dict, field: str, why: str) -> None:
    raise ValueError(f"config field {field}={cfg.get(field)!r} is not supported: {why}")


def _refuse_unimplemented(cfg: dict, model_type: str) -> None:
    def refuse(field: str, why: str) -> None:
        _refuse(cfg, field, why)

    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the MLP is SiLU-and-mul")
    if cfg.get("attention_bias") and model_type != "qwen2":
        refuse("attention_bias", f"{model_type}'s projections have no bias here")
    if cfg.get("mlp_bias"):
        refuse("mlp_bias", "the MLP's projections have no bias here")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
        field = "use_sliding_window" if cfg.get("use_sliding_window") else "layer_types"
        refuse(field, "every layer attends to the whole context (no sliding window)")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        refuse("pretraining_tp", "transformers' split projections are not implemented")


def gemma3_text_config(cfg: dict) -> dict:
    """A multimodal Gemma 3 config's text model (`text_config`), with Gemma3TextConfig's
    defaults for the fields it leaves out."""
    return {**GEMMA3_DEFAULTS, **cfg.get("text_config", {}), "model_type": "gemma3_text"}


def _gemma3_shape(cfg: dict) -> ModelShape:
    """Gemma 3's text model: the fields its math adds, each checked."""
    if cfg.get("hidden_activation") != "gelu_pytorch_tanh":
        _refuse(cfg, "hidden_activation", "Gemma 3's MLP is GeGLU with tanh-approximated GELU")
    for field in ("attention_bias", "use_bidirectional_attention"):
        if cfg.get(field):
            _refuse(cfg, field, "Gemma 3's attention here is causal, without biases")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # older files: every `sliding_window_pattern`-th layer is global
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if len(types) != layers or not set(types) <= {FULL, SLIDING}:
        _refuse(cfg, "layer_types", f"one of {FULL!r}, {SLIDING!r} for each of {layers} layers")
    window = cfg.get("sliding_window")
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        _refuse(cfg, "sliding_window", "sliding layers need a window of at least one position")
    # The global layers' rope: `rope_parameters["full_attention"]`, or the older top-level
    # `rope_theta` and `rope_scaling`; the local ones': `rope_parameters["sliding_attention"]`
    # or `rope_local_base_freq`.
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get(FULL) or cfg.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg.get("rope_theta") or GEMMA3_ROPE_THETA[FULL])
    local = dict(params.get(SLIDING) or {})
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or GEMMA3_ROPE_THETA[SLIDING])
    positions = {"max_position_embeddings": cfg["max_position_embeddings"]}
    theta, scaling = _rope({"rope_parameters": full, **positions})
    local_theta, local_scaling = _rope({"rope_parameters": local, **positions})
    if local_scaling != RopeScaling():
        raise ValueError("rope scaling of Gemma 3's sliding layers is not supported")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(
            f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})"
        )
    return ModelShape(
        model_type="gemma3_text",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=theta,
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        rope_scaling=scaling,
        qk_norm=True,
        layer_types=tuple(types),
        sliding_window=window if SLIDING in types else None,
        query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
        rope_local_theta=local_theta,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def _rope(cfg: dict) -> tuple[float, RopeScaling]:
    """(theta, scaling) from either form in the wild: `rope_parameters` (transformers 5), or
    `rope_scaling` with a top-level `rope_theta` (older files)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope scaling of type {rope_type!r} is not supported (supported: "
            f"{', '.join(ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor is not supported: rotary covers the whole head")
    if rope_type == "default":
        return theta, RopeScaling()
    known = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    values = {k: params[k] for k in known if params.get(k) is not None}
    if "factor" not in values:
        raise ValueError(f"rope scaling of type {rope_type!r} needs a factor")
    if rope_type == "llama3":
        values.setdefault(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)
        )
    return theta, RopeScaling(rope_type, **values)
