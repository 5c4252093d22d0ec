"""KVCacheManager: which blocks each request holds, prefix-cache lookup and `allocate_slots`
(stage 4: `Scheduler.schedule` calls both). Engine-core side: no tensors.

Blocks are held per KV cache group (engine/core/kv_cache_utils.py): one group of every layer
for a model whose layers all attend the same way, one table per group for a hybrid model, whose
sliding-window groups give back what their window has left behind (kv_cache_coordinator.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from stepscope.engine.core.block_pool import BlockPool, KVCacheBlock
from stepscope.engine.core.kv_cache_coordinator import BlocksByGroup, KVCacheCoordinator
from stepscope.engine.core.kv_cache_utils import KVCacheGroupSpec, cdiv
from stepscope.engine.core.request import Request

__all__ = ["KVCacheBlocks", "KVCacheManager", "cdiv"]


class KVCacheBlocks(list):
    """Blocks of one request in every group: all of them, group after group, as one list, and
    each group's own in `groups`. With one group (every single-type model) the list is that
    group's table, as the single-table manager always returned."""

    __slots__ = ("groups",)

    def __init__(self, groups: BlocksByGroup) -> None:
        super().__init__(b for group in groups for b in group)
        self.groups = groups

    def block_ids(self) -> list[list[int]]:
        return [[b.block_id for b in group] for group in self.groups]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        kv_cache_groups: list[KVCacheGroupSpec] | None = None,
    ) -> None:
        """`kv_cache_groups`: by default one full-attention group (the layers do not matter to
        the engine core, only how each group keeps its blocks)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = kv_cache_groups or [KVCacheGroupSpec((0,), None)]
        self.coordinator = KVCacheCoordinator(self.groups, num_blocks, block_size, enable_caching)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.last_blocks_short = 0  # how many blocks the last refused allocation lacked

    @property
    def pool(self) -> BlockPool:
        return self.coordinator.pool

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Each request's blocks, every group's in turn (null blocks included)."""
        managers = self.coordinator.managers
        return {
            rid: [b for m in managers for b in m.req_to_blocks.get(rid, [])]
            for rid in managers[0].req_to_blocks
        }

    @property
    def num_cached_blocks(self) -> dict[str, int]:
        """Leading blocks of each request in the prefix-cache index (of the first group)."""
        return self.coordinator.managers[0].num_cached_block

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_blocks_by_group(self) -> list[int]:
        """Blocks each group holds now (a block shared by requests counts once)."""
        return [m.num_blocks_in_use for m in self.coordinator.managers]

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request, in whole blocks, held in every group.

        The last prompt token is never counted: the model must run on at least one token to
        produce the logits of the next one. A request that wants its prompt's logprobs gets no
        hit: the model must run on every prompt token to score it.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return KVCacheBlocks([[] for _ in self.groups]), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits, num_blocks = self.coordinator.find_longest_cache_hit(request.block_hashes, max_blocks)
        return KVCacheBlocks(hits), num_blocks * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a request blocked at the head of the queue looks
        up again every step; only the lookup that led to admission counts)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
    ) -> KVCacheBlocks | None:
        """Give the request room for `num_new_tokens` more tokens of KV in every group, after
        giving back what sliding windows no longer need.

        Returns the newly allocated blocks, or None (and takes nothing) when the pool is short
        of what all groups need together.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        hits = self._by_group(new_computed_blocks)
        rid = request.request_id
        coordinator = self.coordinator
        # The first query of this step is at num_computed_tokens: blocks wholly before its
        # window are free before the count.
        coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = coordinator.get_num_blocks_to_allocate(rid, num_tokens, hits)
        if num_needed > self.pool.num_free_blocks:
            self.last_blocks_short = num_needed - self.pool.num_free_blocks
            return None
        coordinator.save_new_computed_blocks(rid, hits)
        new_blocks = coordinator.allocate_new_blocks(rid, num_tokens)
        coordinator.cache_blocks(request, num_tokens)
        return KVCacheBlocks(new_blocks)

    def _by_group(self, blocks: Sequence[KVCacheBlock] | None) -> BlocksByGroup:
        if isinstance(blocks, KVCacheBlocks):
            return blocks.groups
        if blocks and self.num_groups > 1:
            raise ValueError("with several KV cache groups, hits come as KVCacheBlocks")
        return [list(blocks or [])] + [[] for _ in self.groups[1:]]

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first, so its prefix stays cached
        the longest."""
        self.coordinator.free(request.request_id)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, every group's in turn (one group: its table)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def block_ids_by_group(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group (null block ids where a window freed one)."""
        return [[b.block_id for b in group] for group in self.coordinator.get_blocks(request_id)]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
