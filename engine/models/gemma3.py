"""Gemma 3's decoder forward (worker, stage 6): Llama's batch, weights and tensor parallelism
(engine/models/llama.py), with the parts of Gemma 3's layer that Llama's has not.

- Embeddings scaled by sqrt(hidden), the scale rounded to the model's dtype first.
- RMSNorm as x * (1 + weight), the product in float32 before the cast back (Llama casts first).
- Four norms a layer: before and after attention, before and after the MLP; the residual adds
  the normed output of each sub-layer.
- An RMSNorm over each query and key head (as Qwen3's, with Gemma's form of the weight).
- GeGLU: gelu(gate, tanh approximation) * up.
- Attention scaled by `query_pre_attn_scalar`**-0.5, not head_dim**-0.5.
- Local layers attend to a sliding window of the last `sliding_window` positions with their own
  rope base (`rope_local_theta`); global layers attend to the whole context with `rope_theta`
  and the config's rope scaling. `layer_types` says which is which.
- Attention logits soft-capped (`attn_logit_softcapping`, passed to the attention backend, as
  vLLM passes it; transformers' Gemma 3 leaves it out, and every Gemma 3 config sets none) and
  final logits soft-capped (tanh(logits / cap) * cap) where the config sets them.

A multimodal folder (Gemma3ForConditionalGeneration) runs its text model: its weights are read
under the text model's names (`text_weights`), its vision tower left unread.

Numerics follow transformers' Gemma3ForCausalLM op for op, so float32 greedy tokens match its
`generate`. The fused decode kernel (fused_decode.py) runs Llama's layer, never this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stepscope.engine.layers.attention import AttentionMetadata
from stepscope.engine.layers.rotary import RopeScaling, rope_inv_freq
from stepscope.engine.models.config import SLIDING
from stepscope.engine.models.llama import LlamaLayer, LlamaModel, _quantized, _to

NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# A multimodal checkpoint's (Gemma3ForConditionalGeneration) names for its text model's weights;
# its vision tower and projector are not read.
TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)


def text_weights(weights: dict) -> dict:
    """The text model's weights under Gemma3ForCausalLM's names, from either kind of folder."""
    if not any(name.startswith(("language_model.", "model.language_model.")) for name in weights):
        return weights
    out = {}
    for name, tensor in weights.items():
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                out[new + name.removeprefix(old)] = tensor
    return out


def _one_plus(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma norm's weight as it multiplies: 1 + weight, in float32."""
    return 1.0 + weight.float()


class Gemma3Layer(LlamaLayer):
    def __init__(self, w: dict[str, torch.Tensor], shape, tp_size: int, pack) -> None:
        super().__init__(w, shape, tp_size, pack)
        self.input_norm = _one_plus(self.input_norm)
        self.post_norm = _one_plus(self.post_norm)  # on the attention's output
        self.pre_ff_norm = _one_plus(w["pre_feedforward_layernorm.weight"])
        self.post_ff_norm = _one_plus(w["post_feedforward_layernorm.weight"])
        self.q_norm = _one_plus(self.q_norm)
        self.k_norm = _one_plus(self.k_norm)
        self.scale = shape.query_pre_attn_scalar**-0.5
        self.sliding_window: int | None = None  # set by the model for local layers


class Gemma3Model(LlamaModel):
    layer_class = Gemma3Layer

    def __init__(self, shape, weights, attn, device, dtype, *args, **kwargs) -> None:
        kwargs["fused_decode"] = False  # the fused kernel runs Llama's layer
        weights = text_weights(weights)
        super().__init__(shape, weights, attn, device, dtype, *args, **kwargs)
        self.norm = _one_plus(self.norm)
        # transformers multiplies by the scale as a tensor of the weights' dtype.
        self.embed_scale = torch.tensor(shape.hidden_size**0.5).to(device=device, dtype=dtype)
        self.global_rope = self.rope_cache  # Llama's: rope_theta with the config's scaling
        inv_freq = rope_inv_freq(shape.head_dim, shape.rope_local_theta, RopeScaling())
        self.local_rope = self.ops.rope_cache(
            shape.max_position_embeddings, inv_freq, device, dtype
        )
        for layer, kind in zip(self.layers, shape.layer_types, strict=True):
            layer.sliding_window = shape.sliding_window if kind == SLIDING else None

    def _layer_weights(self, w, i: int, rank: int, size: int) -> dict[str, torch.Tensor]:
        out = super()._layer_weights(w, i, rank, size)
        for name in NORMS:
            out[f"{name}.weight"] = _to(w[f"model.layers.{i}.{name}.weight"], self.device)
        return out

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm; `weight` is 1 + the checkpoint's, float32."""
        if x.dtype == torch.float32:  # the backend's kernel computes this very product
            return self.ops.rms_norm(x.contiguous(), weight, eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * weight).to(x.dtype)

    def _add_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            return self.ops.add_rms_norm(x, residual, weight, eps)
        x = x + residual
        return self._norm(x, weight, eps), x

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        metas: list[AttentionMetadata],  # per KV cache group
        kv_group_of_layer: list[int],  # per layer, the index of its group's metadata
    ) -> torch.Tensor:  # [num_tokens, hidden]
        linear = self.linear
        if _quantized(self.embed):
            x = self.embed.embed(input_ids).to(self.dtype)
        else:
            x = F.embedding(input_ids, self.embed)
        x = x * self.embed_scale
        residual = None  # the residual stream; x is the last sub-layer's output until it is added
        n = input_ids.shape[0]
        soft_cap = self.shape.attn_logit_softcapping
        for layer, (k_cache, v_cache), group in zip(
            self.layers, kv_caches, kv_group_of_layer, strict=True
        ):
            meta = metas[group]
            if residual is None:
                x, residual = self._norm(x, layer.input_norm, layer.eps), x
            else:
                x, residual = self._add_norm(x, residual, layer.input_norm, layer.eps)
            qkv = linear(x, layer.qkv)
            hq, hk = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            q = qkv[:, :hq].reshape(-1, layer.head_dim)
            k = qkv[:, hq : hq + hk].reshape(-1, layer.head_dim)
            v = qkv[:, hq + hk :].view(n, layer.num_kv_heads, layer.head_dim)
            q = self._norm(q, layer.q_norm, layer.eps).view(n, layer.num_heads, layer.head_dim)
            k = self._norm(k, layer.k_norm, layer.eps).view(n, layer.num_kv_heads, layer.head_dim)
            local = layer.sliding_window is not None
            rope = self.local_rope if local else self.global_rope
            q, k = self.ops.rotary(positions, q, k, rope)
            o = self.attn.forward(
                q, k, v.contiguous(), k_cache, v_cache, meta, layer.scale,
                sliding_window=layer.sliding_window, logits_soft_cap=soft_cap,
            )  # fmt: skip
            x = self._reduce(linear(o.reshape(n, hq), layer.o_proj))
            x = self._norm(x, layer.post_norm, layer.eps)
            x, residual = self._add_norm(x, residual, layer.pre_ff_norm, layer.eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            x = self._reduce(linear(F.gelu(gate, approximate="tanh").mul_(up), layer.down))
            x = self._norm(x, layer.post_ff_norm, layer.eps)
        return self._add_norm(x, residual, self.norm, self.shape.rms_norm_eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        logits = self.linear(hidden, self.lm_head)
        cap = self.shape.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as transformers caps
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
