"""Rotary embedding kernel against its PyTorch reference, and the reference against transformers."""

import pytest
import torch

from stepscope.kernels.rotary_embedding import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 1), (4, 4), (9, 3)])
def test_rotary_embedding_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    tol: dict[str, float],
    device: torch.device,
) -> None:
    cache = build_cos_sin_cache(512, head_dim, 10000.0).to(device)
    positions = torch.randint(0, 512, (21,), device=device)
    q = torch.randn(21, num_heads, head_dim).to(device, dtype)
    k = torch.randn(21, num_kv_heads, head_dim).to(device, dtype)

    q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)

    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(k_out, k_ref, **tol)


def test_rotary_embedding_accepts_q_and_k_sliced_from_fused_qkv(device: torch.device) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 64
    cache = build_cos_sin_cache(64, head_dim, 500000.0).to(device)
    positions = torch.arange(num_tokens, device=device) + 30
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    qkv_before = qkv.clone()

    q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)

    torch.testing.assert_close(q_out, q_ref)
    torch.testing.assert_close(k_out, k_ref)
    assert torch.equal(qkv, qkv_before)


def test_rotary_reference_matches_transformers_llama_rotary_embedding() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    head_dim, theta = 64, 100000.0
    config = LlamaConfig(
        hidden_size=3 * head_dim,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rope_theta=theta,
    )
    positions = torch.tensor([0, 5, 17, 255])
    q = torch.randn(4, 3, head_dim)
    k = torch.randn(4, 1, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # transformers lays heads out as [batch, heads, seq, head_dim].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    q_ref, k_ref = rotary_embedding_ref(positions, q, k, build_cos_sin_cache(256, head_dim, theta))

    torch.testing.assert_close(q_ref, q_hf[0].transpose(0, 1))
    torch.testing.assert_close(k_ref, k_hf[0].transpose(0, 1))
