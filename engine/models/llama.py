"""The decoder forward over a flat, mixed batch of tokens and a paged KV cache (worker, stage 6):
Llama, and the Qwen2 and Qwen3 families, whose differences are two optional parts of a layer
(q/k/v biases, per-head q/k RMSNorm; see engine/models/config.py for the table).

Tokens of every scheduled request are concatenated into one [num_tokens] batch: projections and
MLPs run as single matmuls over the whole step, and only attention looks at request boundaries
(through the attention backend's metadata). Q/K/V and gate/up projections are fused into one
matmul each. RMSNorm (with the residual add before it), rotary and SiLU-and-mul come from the
attention backend's `ops`: torch ops, or Triton kernels with the triton backend. Numerics follow
transformers' LlamaForCausalLM (Qwen2ForCausalLM, Qwen3ForCausalLM), op for op, so float32 greedy
tokens match its `generate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stepscope.engine.layers.attention import AttentionBackend, AttentionMetadata
from stepscope.engine.layers.quantization import QuantizedWeight
from stepscope.engine.layers.rotary import rope_inv_freq
from stepscope.engine.models.config import ModelShape
from stepscope.engine.models.fused_decode import FusedDecode, fused_decode_reason
from stepscope.engine.models.linear import make_linear


class LlamaLayer:
    def __init__(self, w: dict[str, torch.Tensor], shape: ModelShape, tp_size: int, pack) -> None:
        self.input_norm = w["input_layernorm.weight"]
        self.post_norm = w["post_attention_layernorm.weight"]
        # Projection weights as the linear op wants them (packed once for oneDNN bfloat16).
        self.qkv = pack(w["qkv_proj.weight"])  # [(H + 2 * KVH) * D / tp, hidden]
        self.o_proj = pack(w["o_proj.weight"])  # [hidden, H * D / tp]
        self.gate_up = pack(w["gate_up_proj.weight"])  # [2 * intermediate / tp, hidden]
        self.down = pack(w["down_proj.weight"])  # [hidden, intermediate / tp]
        self.qkv_bias = w.get("qkv_proj.bias")  # Qwen2: [(H + 2 * KVH) * D / tp]
        self.q_norm = w.get("q_norm.weight")  # Qwen3: [D], over each head
        self.k_norm = w.get("k_norm.weight")
        self.num_heads = shape.num_heads // tp_size
        self.num_kv_heads = shape.num_kv_heads // tp_size
        self.head_dim = shape.head_dim
        self.eps = shape.rms_norm_eps
        self.scale = shape.head_dim**-0.5


class LlamaModel:
    """Weights as plain tensors; `forward` is one step. Tensor parallel when tp_size > 1:
    column-parallel Q/K/V and gate/up, row-parallel o_proj and down_proj, sharded by heads."""

    layer_class = LlamaLayer  # Gemma 3's model (gemma3.py) reads more of each layer

    def __init__(
        self,
        shape: ModelShape,
        weights: dict[str, torch.Tensor],
        attn: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce=None,
        quantized_max_tokens: int | None = None,
        fused_decode: bool = True,
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
        quantized = any(isinstance(v, QuantizedWeight) for v in weights.values())
        self.linear = make_linear(device, dtype, quantized, quantized_max_tokens)
        # GGUF blocks stay as repacked; every other tensor takes the model's dtype and device.
        w = {k: v if isinstance(v, QuantizedWeight) else v.to(dtype) for k, v in weights.items()}
        self.embed = _to(w["model.embed_tokens.weight"], device)
        self.norm = w["model.norm.weight"].to(device)
        head = self.embed if shape.tie_word_embeddings else _to(w["lm_head.weight"], device)
        self.lm_head = self.linear.pack(head)
        self.layers = [
            self.layer_class(
                self._layer_weights(w, i, tp_rank, tp_size), shape, tp_size, self.linear.pack
            )
            for i in range(shape.num_layers)
        ]
        inv_freq = rope_inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling)
        self.rope_cache = self.ops.rope_cache(
            shape.max_position_embeddings, inv_freq, device, dtype
        )
        # Small decode steps of GGUF weights: every layer in one C call (fused_decode.py).
        self.fused_decode = None
        if fused_decode and fused_decode_reason(self) is None:
            self.fused_decode = FusedDecode(self, quantized_max_tokens)

    def _layer_weights(
        self, w: dict[str, torch.Tensor], i: int, rank: int, size: int
    ) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        s = self.shape

        def rows(t):  # column-parallel: split output features (whole heads for q/k/v)
            n = t.shape[0] // size
            return t.rows(slice(rank * n, (rank + 1) * n)) if _quantized(t) else t.chunk(size)[rank]

        def cols(t):  # row-parallel: split input features
            n = t.shape[1] // size
            return t.columns(rank * n, (rank + 1) * n) if _quantized(t) else t.chunk(size, 1)[rank]

        def cat(parts):
            if any(_quantized(t) for t in parts):
                return QuantizedWeight.cat(parts)
            return torch.cat(parts)

        def fused_qkv(kind: str):  # Q, K, V stacked, each sharded by whole heads
            return cat([rows(w[f"{p}self_attn.{name}_proj.{kind}"]) for name in "qkv"])

        qkv = fused_qkv("weight")
        gate_up = cat([rows(w[p + "mlp.gate_proj.weight"]), rows(w[p + "mlp.up_proj.weight"])])
        out = {
            "input_layernorm.weight": w[p + "input_layernorm.weight"],
            "post_attention_layernorm.weight": w[p + "post_attention_layernorm.weight"],
            "qkv_proj.weight": qkv,
            "o_proj.weight": cols(w[p + "self_attn.o_proj.weight"]),
            "gate_up_proj.weight": gate_up,
            "down_proj.weight": cols(w[p + "mlp.down_proj.weight"]),
        }
        if s.qkv_bias:
            out["qkv_proj.bias"] = fused_qkv("bias")
        if s.qk_norm:
            out["q_norm.weight"] = w[p + "self_attn.q_norm.weight"]
            out["k_norm.weight"] = w[p + "self_attn.k_norm.weight"]
        return {k: _to(t, self.device) for k, t in out.items()}

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            self.all_reduce(x)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        metas: list[AttentionMetadata],  # per KV cache group
        kv_group_of_layer: list[int],  # per layer, the index of its group's metadata
    ) -> torch.Tensor:  # [num_tokens, hidden]
        ops, linear = self.ops, self.linear
        if _quantized(self.embed):
            x = self.embed.embed(input_ids).to(self.dtype)
        else:
            x = F.embedding(input_ids, self.embed)
        residual = None  # the residual stream; x is the last sub-layer's output until it is added
        n = input_ids.shape[0]
        if self.fused_decode is not None and self.fused_decode.takes(n, metas):
            x, residual = self.fused_decode(x, positions, kv_caches, metas[0])
            return ops.add_rms_norm(x, residual, self.norm, self.shape.rms_norm_eps)[0]
        for layer, (k_cache, v_cache), group in zip(
            self.layers, kv_caches, kv_group_of_layer, strict=True
        ):
            meta = metas[group]
            if residual is None:
                x, residual = ops.rms_norm(x, layer.input_norm, layer.eps), x
            else:
                x, residual = ops.add_rms_norm(x, residual, layer.input_norm, layer.eps)
            qkv = linear(x, layer.qkv)
            if layer.qkv_bias is not None:  # Qwen2
                qkv += layer.qkv_bias
            hq, hk = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            q = qkv[:, :hq].view(n, layer.num_heads, layer.head_dim)
            k = qkv[:, hq : hq + hk].view(n, layer.num_kv_heads, layer.head_dim)
            v = qkv[:, hq + hk :].view(n, layer.num_kv_heads, layer.head_dim)
            if layer.q_norm is not None:  # Qwen3: RMSNorm over each head, before rotary
                q = ops.rms_norm(q.reshape(-1, layer.head_dim), layer.q_norm, layer.eps).view_as(q)
                k = ops.rms_norm(k.reshape(-1, layer.head_dim), layer.k_norm, layer.eps).view_as(k)
            q, k = ops.rotary(positions, q, k, self.rope_cache)
            o = self.attn.forward(q, k, v.contiguous(), k_cache, v_cache, meta, layer.scale)
            x = self._reduce(linear(o.reshape(n, hq), layer.o_proj))
            x, residual = ops.add_rms_norm(x, residual, layer.post_norm, layer.eps)
            x = self._reduce(linear(ops.silu_and_mul(linear(x, layer.gate_up)), layer.down))
        return ops.add_rms_norm(x, residual, self.norm, self.shape.rms_norm_eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return self.linear(hidden, self.lm_head).float()


def _quantized(t) -> bool:
    return isinstance(t, QuantizedWeight)


def _to(t, device: torch.device):
    """A dense tensor contiguous on `device`; GGUF blocks as they are (CPU only)."""
    return t if _quantized(t) else t.contiguous().to(device)
