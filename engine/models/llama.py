"""The Llama forward over a flat, mixed batch of tokens and a paged KV cache (worker, stage 6).

Tokens of every scheduled request are concatenated into one [num_tokens] batch: projections and
MLPs run as single matmuls over the whole step, and only attention looks at request boundaries
(through the attention backend's metadata). Q/K/V and gate/up projections are fused into one
matmul each. RMSNorm (with the residual add before it), rotary and SiLU-and-mul come from the
attention backend's `ops`: torch ops, or Triton kernels with the triton backend. Numerics follow
transformers' LlamaForCausalLM, op for op, so float32 greedy tokens match its `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stepscope.engine.layers.attention import AttentionBackend, AttentionMetadata
from stepscope.engine.models.linear import make_linear


@dataclass(frozen=True, slots=True)
class LlamaShape:
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

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaShape:
        if cfg.get("model_type", "llama") != "llama":
            raise ValueError(f"only Llama models are supported, got {cfg.get('model_type')!r}")
        rope = cfg.get("rope_parameters") or {}
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )


class LlamaLayer:
    def __init__(self, w: dict[str, torch.Tensor], shape: LlamaShape, tp_size: int, pack) -> None:
        self.input_norm = w["input_layernorm.weight"]
        self.post_norm = w["post_attention_layernorm.weight"]
        # Projection weights as the linear op wants them (packed once for oneDNN bfloat16).
        self.qkv = pack(w["qkv_proj.weight"])  # [(H + 2 * KVH) * D / tp, hidden]
        self.o_proj = pack(w["o_proj.weight"])  # [hidden, H * D / tp]
        self.gate_up = pack(w["gate_up_proj.weight"])  # [2 * intermediate / tp, hidden]
        self.down = pack(w["down_proj.weight"])  # [hidden, intermediate / tp]
        self.num_heads = shape.num_heads // tp_size
        self.num_kv_heads = shape.num_kv_heads // tp_size
        self.head_dim = shape.head_dim
        self.eps = shape.rms_norm_eps
        self.scale = shape.head_dim**-0.5


class LlamaModel:
    """Weights as plain tensors; `forward` is one step. Tensor parallel when tp_size > 1:
    column-parallel Q/K/V and gate/up, row-parallel o_proj and down_proj, sharded by heads."""

    def __init__(
        self,
        shape: LlamaShape,
        weights: dict[str, torch.Tensor],
        attn: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce=None,
    ) -> None:
        if shape.num_heads % tp_size or shape.num_kv_heads % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} must divide the model's {shape.num_heads} "
                f"query heads and {shape.num_kv_heads} KV heads"
            )
        self.shape = shape
        self.attn = attn
        self.ops = attn.ops
        self.device = device
        self.dtype = dtype
        self.tp_size = tp_size
        self.all_reduce = all_reduce
        self.linear = make_linear(device, dtype)
        w = {k: v.to(dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"].to(device)
        self.norm = w["model.norm.weight"].to(device)
        head = self.embed if shape.tie_word_embeddings else w["lm_head.weight"].to(device)
        self.lm_head = self.linear.pack(head)
        self.layers = [
            LlamaLayer(
                self._layer_weights(w, i, tp_rank, tp_size), shape, tp_size, self.linear.pack
            )
            for i in range(shape.num_layers)
        ]
        self.rope_cache = self.ops.rope_cache(
            shape.max_position_embeddings, shape.head_dim, shape.rope_theta, device, dtype
        )

    def _layer_weights(
        self, w: dict[str, torch.Tensor], i: int, rank: int, size: int
    ) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        s = self.shape

        def rows(t: torch.Tensor) -> torch.Tensor:  # column-parallel: split output features
            return t.chunk(size, dim=0)[rank]

        def cols(t: torch.Tensor) -> torch.Tensor:  # row-parallel: split input features
            return t.chunk(size, dim=1)[rank]

        q = rows(w[p + "self_attn.q_proj.weight"].view(s.num_heads, s.head_dim, -1))
        k = rows(w[p + "self_attn.k_proj.weight"].view(s.num_kv_heads, s.head_dim, -1))
        v = rows(w[p + "self_attn.v_proj.weight"].view(s.num_kv_heads, s.head_dim, -1))
        qkv = torch.cat([t.reshape(-1, s.hidden_size) for t in (q, k, v)])
        gate_up = torch.cat(
            [rows(w[p + "mlp.gate_proj.weight"]), rows(w[p + "mlp.up_proj.weight"])]
        )
        out = {
            "input_layernorm.weight": w[p + "input_layernorm.weight"],
            "post_attention_layernorm.weight": w[p + "post_attention_layernorm.weight"],
            "qkv_proj.weight": qkv,
            "o_proj.weight": cols(w[p + "self_attn.o_proj.weight"]),
            "gate_up_proj.weight": gate_up,
            "down_proj.weight": cols(w[p + "mlp.down_proj.weight"]),
        }
        return {k: t.contiguous().to(self.device) for k, t in out.items()}

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            self.all_reduce(x)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        ops, linear = self.ops, self.linear
        x = F.embedding(input_ids, self.embed)
        residual = None  # the residual stream; x is the last sub-layer's output until it is added
        n = input_ids.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if residual is None:
                x, residual = ops.rms_norm(x, layer.input_norm, layer.eps), x
            else:
                x, residual = ops.add_rms_norm(x, residual, layer.input_norm, layer.eps)
            qkv = linear(x, layer.qkv)
            hq, hk = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            q = qkv[:, :hq].view(n, layer.num_heads, layer.head_dim)
            k = qkv[:, hq : hq + hk].view(n, layer.num_kv_heads, layer.head_dim)
            v = qkv[:, hq + hk :].view(n, layer.num_kv_heads, layer.head_dim)
            q, k = ops.rotary(positions, q, k, self.rope_cache)
            o = self.attn.forward(q, k, v.contiguous(), k_cache, v_cache, meta, layer.scale)
            x = self._reduce(linear(o.reshape(n, hq), layer.o_proj))
            x, residual = ops.add_rms_norm(x, residual, layer.post_norm, layer.eps)
            x = self._reduce(linear(ops.silu_and_mul(linear(x, layer.gate_up)), layer.down))
        return ops.add_rms_norm(x, residual, self.norm, self.shape.rms_norm_eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return self.linear(hidden, self.lm_head).float()
