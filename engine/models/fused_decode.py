"""Every decoder layer of a small decode step in one C call (worker forward, stage 6).

At one stream a decode step is one token: each layer's work is a few hundred microseconds of
reading weights, and the Python forward adds as much again dispatching its ops one by one
(norms, four products, rotary, the cache write, attention, SiLU-and-mul). With GGUF weights on
the cpu attention backend, a step whose every request decodes, of up to the quantized path's
step size, runs the same kernels in the same order from C instead
(kernels/cpu/decode_layers.c); the embedding before and the final norm and LM head after stay
in Python. Each layer's weight addresses are gathered once, here.

Where it does not apply (prefill or mixed steps, tensor parallelism, Qwen's q/k/v bias or q/k
norms, Gemma 3's layers, several KV cache groups, dense weights, another backend), the Python
forward runs, and `reason` says why.
"""

from __future__ import annotations

import torch

from stepscope.engine.layers.attention import AttentionMetadata
from stepscope.engine.layers.quantization import QuantizedWeight


def fused_decode_reason(model) -> str | None:
    """None where `FusedDecode` can run `model`'s decode steps; else why not."""
    if model.attn.name != "cpu":
        return f"the {model.attn.name} attention backend (it needs cpu)"
    if model.tp_size > 1:
        return "tensor parallelism (each layer all-reduces between its kernels)"
    if model.shape.model_type not in ("llama", "qwen2", "qwen3"):
        return f"{model.shape.model_type}'s layers (the kernel runs Llama's)"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.dtype}"
    for layer in model.layers:
        if layer.qkv_bias is not None or layer.q_norm is not None:
            return "q/k/v biases or q/k norms (Qwen2, Qwen3)"
        projections = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        if not all(isinstance(w, QuantizedWeight) for w in projections):
            return "dense weights (it runs GGUF blocks)"
    return None


class FusedDecode:
    """The decoder layers of `model` as one kernel call for decode steps of up to
    `max_tokens` tokens (None: any)."""

    def __init__(self, model, max_tokens: int | None) -> None:
        from stepscope.kernels.cpu.build import load

        suffix = {torch.float32: "f32", torch.bfloat16: "bf16"}[model.dtype]
        self._kernel = load()[f"decode_layers_{suffix}"].fn
        self.model = model
        self.max_tokens = max_tokens
        weights, formats = [], []
        for layer in model.layers:
            weights += [layer.input_norm.data_ptr(), layer.post_norm.data_ptr()]
            for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                weights += [w.qs.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr()]
                formats += [w.bits, w.block]
        self._weights = torch.tensor(weights, dtype=torch.int64)
        self._formats = torch.tensor(formats, dtype=torch.int64)
        self._caches: torch.Tensor | None = None
        self._cache_key: tuple[int, ...] = ()

    def takes(self, num_tokens: int, metas: list[AttentionMetadata]) -> bool:
        """A step of decodes only (one token each), small enough for the quantized path, of a
        model with one KV cache group (the kernel runs one block table for every layer)."""
        small = self.max_tokens is None or num_tokens <= self.max_tokens
        return small and len(metas) == 1 and metas[0].num_decodes == num_tokens

    def __call__(
        self,
        x: torch.Tensor,  # [tokens, hidden]: the embeddings
        positions: torch.Tensor,  # [tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the last layer's output, the residual stream
        m, s = self.model, self.model.shape
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if key != self._cache_key:  # the pool, allocated once; looked at every step
            self._caches, self._cache_key = torch.tensor(key, dtype=torch.int64), key
        x = x.contiguous()
        residual = torch.empty_like(x)
        positions = positions.contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables[: meta.num_decodes].contiguous()
        seq_lens = meta.seq_lens[: meta.num_decodes].contiguous()
        layer = m.layers[0]
        block_size = kv_caches[0][0].shape[1]
        status = self._kernel(
            x.data_ptr(), residual.data_ptr(), self._weights.data_ptr(),
            self._formats.data_ptr(), len(m.layers), self._caches.data_ptr(), x.shape[0],
            s.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim,
            s.intermediate_size, layer.eps, layer.scale, positions.data_ptr(),
            m.rope_cache.data_ptr(), m.rope_cache.shape[0], slots.data_ptr(),
            tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), block_size,
            meta.max_decode_len, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"decode_layers failed with code {status} (decode_layers.c)")
        return x, residual
