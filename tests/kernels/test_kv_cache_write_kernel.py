"""KV-cache write kernel against its PyTorch reference."""

import pytest
import torch

from stepscope.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref


def empty_caches(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.full(shape, -7.0, dtype=dtype, device=device),
        torch.full(shape, -9.0, dtype=dtype, device=device),
    )


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_matches_reference(
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    num_blocks, num_tokens = 6, 37
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(device, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(device, dtype)
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens].to(device)
    k_cache, v_cache = empty_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    write_kv_cache_ref(key, value, k_ref, v_ref, slot_mapping)

    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


def test_write_kv_cache_skips_negative_slots(device: torch.device) -> None:
    block_size, num_kv_heads, head_dim = 16, 2, 64
    key = torch.randn(5, num_kv_heads, head_dim, device=device)
    value = torch.randn(5, num_kv_heads, head_dim, device=device)
    slot_mapping = torch.tensor([3, -1, 17, -1, 40], device=device)
    k_cache, v_cache = empty_caches(3, block_size, num_kv_heads, head_dim, torch.float32, device)

    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    written = torch.tensor([3, 17, 40], device=device)
    torch.testing.assert_close(flat_k[written], key[[0, 2, 4]], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[written], value[[0, 2, 4]], atol=0, rtol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=device)
    untouched[written] = False
    assert (flat_k[untouched] == -7.0).all()
    assert (flat_v[untouched] == -9.0).all()
