"""Every KV cache group's manager over one block pool (engine core, stage 4; vLLM's
`kv_cache_coordinator.py`): a request's prefix-cache hit must hold in every group, and its
blocks are counted, taken and freed in all groups at once.
"""

from __future__ import annotations

from stepscope.engine.core.block_pool import BlockPool, KVCacheBlock
from stepscope.engine.core.kv_cache_utils import KVCacheGroupSpec, needs_null_block
from stepscope.engine.core.request import Request
from stepscope.engine.core.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    make_manager,
)

BlocksByGroup = list[list[KVCacheBlock]]


class KVCacheCoordinator:
    def __init__(
        self,
        groups: list[KVCacheGroupSpec],
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
    ) -> None:
        self.groups = groups
        self.block_size = block_size
        self.pool = BlockPool(
            num_blocks, enable_caching, reserve_null_block=needs_null_block(groups)
        )
        self.managers = [make_manager(g, i, self.pool, block_size) for i, g in enumerate(groups)]
        # Groups of one attention type are looked up together; full attention first, as its
        # hit (a plain prefix) bounds the others' quickly.
        by_type: dict[tuple[type, int | None], list[SingleTypeKVCacheManager]] = {}
        for m in sorted(self.managers, key=lambda m: m.spec.frees_outside_window):
            by_type.setdefault((type(m), m.spec.sliding_window), []).append(m)
        self.attention_types = list(by_type.values())

    def find_longest_cache_hit(
        self, block_hashes: list[bytes], max_num_blocks: int
    ) -> tuple[BlocksByGroup, int]:
        """The longest hit, in blocks, that every group holds, and each group's blocks for it.

        Each attention type's hit bounds the next type's search, round after round, until all
        agree (one type: one round). A full-attention hit is any prefix of its longest one; a
        sliding-window hit is not, so each type answers again for the length agreed."""
        length = max_num_blocks
        results: dict[int, BlocksByGroup] = {}
        agreed = False
        while not agreed:
            agreed = True
            for i, managers in enumerate(self.attention_types):
                hits = type(managers[0]).find_longest_cache_hit(block_hashes, length, managers)
                results[i] = hits
                if len(hits[0]) < length:
                    length, agreed = len(hits[0]), i == 0
        by_group: BlocksByGroup = [[] for _ in self.managers]
        for i, managers in enumerate(self.attention_types):
            for m, hits in zip(managers, results[i], strict=True):
                by_group[m.group_id] = hits
        return by_group, length

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: BlocksByGroup
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, hits)
            for m, hits in zip(self.managers, new_computed_blocks, strict=True)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: BlocksByGroup) -> None:
        for m, hits in zip(self.managers, new_computed_blocks, strict=True):
            m.save_new_computed_blocks(request_id, hits)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> BlocksByGroup:
        return [m.allocate_new_blocks(request_id, num_tokens) for m in self.managers]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> BlocksByGroup:
        return [m.req_to_blocks.get(request_id, []) for m in self.managers]
