"""Rotary position embedding's frequencies, with the scalings checkpoints ask for (worker).

A rotary embedding turns each position p into angles p * inv_freq[i], one per pair of a head's
dimensions; `ops.rope_cache` turns them into the cos/sin table the `rotary` op reads by position.
Scaling changes only `inv_freq`, so it is computed once here, as transformers computes it:
- `default`: inv_freq[i] = 1 / theta^(2i / head_dim).
- `linear`: every frequency divided by `factor` (positions stretched by it).
- `dynamic` (NTK): transformers rescales only once a sequence outgrows `max_position_embeddings`;
  stepscope caps the context there, so the frequencies are the default ones.
- `llama3` (Llama 3.1 and later): long wavelengths divided by `factor`, short ones kept, and
  a smooth blend between `low_freq_factor` and `high_freq_factor` of the original context.
vLLM has the same in vllm/model_executor/layers/rotary_embedding.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the API server reads RopeScaling and runs no torch
    import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, scaled as `scaling` says."""
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if scaling.rope_type not in ("default", "dynamic"):
        raise ValueError(f"rope type {scaling.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    import torch

    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor  # longer than this: divided by factor
    high_freq_wavelen = old_len / s.high_freq_factor  # shorter than this: kept
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)
