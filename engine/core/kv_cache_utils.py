"""KV cache groups: which layers share one block table (engine core and worker agree on them by
computing them from the same model shape; vLLM's `kv_cache_utils.get_kv_cache_groups`).

A model whose layers all attend the same way has one group of every layer: one block table per
request, exactly the single-table cache stepscope always had. A hybrid model (Gemma 3: five
sliding-window layers to each full-attention layer) splits its layers into groups of equal
size, one attention type per group, so that every group's blocks are the same number of bytes
and all groups draw from one pool: block i of the pool is "block i of KV tensor pair j" for the
j-th layer of whichever group holds block i. The worker then allocates `group_size` tensor
pairs, not one per layer, and each group keeps its own block table, so a sliding-window group
can give back the blocks its window has left behind while the full-attention group keeps all.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table, all attending the same way."""

    layer_ids: tuple[int, ...]
    # Keys a query attends to, its own included (None: the whole context). A group with a
    # window keeps all its blocks when `keeps_all_blocks` (the hybrid manager switched off).
    sliding_window: int | None = None
    keeps_all_blocks: bool = False

    @property
    def frees_outside_window(self) -> bool:
        return self.sliding_window is not None and not self.keeps_all_blocks


def get_kv_cache_groups(
    layer_types: tuple[str, ...],
    sliding_window: int | None = None,
    disable_hybrid: bool = False,
) -> list[KVCacheGroupSpec]:
    """The KV cache groups of a model with these per-layer attention types.

    One type, or the hybrid manager off: one group of every layer (with the switch off, a window
    still applies in the kernels, but every block is kept). Otherwise each type's layers, in
    layer order, are cut into groups of `group_size` layers: the fewest layers any type has
    (or the most, when that is within 25% of the fewest, to avoid many half-empty groups), as
    vLLM cuts them. Full-attention groups come first.
    """
    if not layer_types:
        raise ValueError("a model needs at least one layer")
    unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise ValueError(f"unknown attention layer types {sorted(unknown)}")
    has_window = SLIDING_ATTENTION in layer_types
    if has_window and sliding_window is None:
        raise ValueError("sliding_attention layers need a sliding_window")
    window = sliding_window if has_window else None
    by_type = {
        t: tuple(i for i, lt in enumerate(layer_types) if lt == t)
        for t in (FULL_ATTENTION, SLIDING_ATTENTION)
        if t in layer_types
    }
    if len(by_type) == 1 or disable_hybrid:
        only_window = window if by_type.keys() == {SLIDING_ATTENTION} else None
        keep_all = disable_hybrid and window is not None
        return [
            KVCacheGroupSpec(tuple(range(len(layer_types))), only_window, keep_all)
        ]  # fmt: skip
    fewest = min(len(ids) for ids in by_type.values())
    most = max(len(ids) for ids in by_type.values())
    group_size = most if most < fewest * 1.25 else fewest
    groups = []
    for t, ids in by_type.items():
        for start in range(0, len(ids), group_size):
            layer_ids = ids[start : start + group_size]
            groups.append(KVCacheGroupSpec(layer_ids, window if t == SLIDING_ATTENTION else None))
    return groups


def kv_cache_groups_for(shape, disable_hybrid: bool = False) -> list[KVCacheGroupSpec]:
    """The groups of a model shape (engine/models/config.py's `ModelShape`)."""
    return get_kv_cache_groups(shape.layer_types, shape.sliding_window, disable_hybrid)


def kv_group_size(groups: list[KVCacheGroupSpec]) -> int:
    """Layers per group: how many KV tensor pairs the worker allocates (and so the layers one
    block's bytes cover)."""
    return max(len(g.layer_ids) for g in groups)


def kv_cache_layout(groups: list[KVCacheGroupSpec], num_layers: int) -> tuple[list[int], list[int]]:
    """Per layer: (its group's index, the index of the tensor pair it uses: its place in its
    group)."""
    group_of, pair_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layer_ids):
            group_of[layer], pair_of[layer] = g, j
    return group_of, pair_of


def needs_null_block(groups: list[KVCacheGroupSpec]) -> bool:
    """A group that frees blocks outside its window puts a reserved null block in their place."""
    return any(g.frees_outside_window for g in groups)
