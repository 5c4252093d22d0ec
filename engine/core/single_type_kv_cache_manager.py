"""The blocks of one KV cache group (engine core, stage 4; vLLM's
`single_type_kv_cache_manager.py`): which blocks each request holds in that group's table,
prefix-cache lookup for the group's attention type, and, for a sliding window, giving back the
blocks the window has left behind.

A block belongs to one group while it is held; its prefix-cache key carries the group (group 0's
key is the block hash itself, so a single-group engine indexes exactly as before), because the
same tokens have different KV in the layers of different groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from stepscope.engine.core.block_pool import BlockPool, KVCacheBlock
from stepscope.engine.core.kv_cache_utils import KVCacheGroupSpec, cdiv
from stepscope.engine.core.request import Request


class SingleTypeKVCacheManager:
    """One group's tables. Full attention as is: every block a request's tokens fill is kept."""

    def __init__(
        self, spec: KVCacheGroupSpec, group_id: int, pool: BlockPool, block_size: int
    ) -> None:
        self.spec = spec
        self.group_id = group_id
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix-cache index.
        self.num_cached_block: dict[str, int] = {}
        self.num_blocks_in_use = 0  # blocks this group holds (a block shared by requests once)

    def cache_key(self, block_hash: bytes) -> bytes:
        return block_hash if not self.group_id else block_hash + self.group_id.to_bytes(2, "little")

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.pool.lookup(self.cache_key(block_hash))

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks this group takes to hold `num_tokens` tokens of the request: new blocks,
        plus the prefix-cache hits that sit in the free queue (taken, they stop being free)."""
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(cdiv(num_tokens, self.block_size) - held - len(new_computed_blocks), 0)
        null = self.pool.null_block
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not null)

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        if not new_computed_blocks:
            return
        null = self.pool.null_block
        self.num_blocks_in_use += sum(
            1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not null
        )
        self.pool.touch(new_computed_blocks)
        self.req_to_blocks.setdefault(request_id, []).extend(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = max(cdiv(num_tokens, self.block_size) - len(blocks), 0)
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self.num_blocks_in_use += num_new
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that `num_tokens` tokens fill (null blocks are skipped)."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        start = self.num_cached_block.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], self.cache_key(request.block_hashes[i]))
        self.num_cached_block[rid] = max(start, end)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so its prefix stays cached the longest."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._release(blocks[::-1])

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        self.pool.free_blocks(blocks)
        null = self.pool.null_block
        self.num_blocks_in_use -= sum(1 for b in blocks if b.ref_cnt == 0 and b is not null)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks no query from `num_computed_tokens` on attends to: none here."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[bytes],
        max_num_blocks: int,
        managers: list[SingleTypeKVCacheManager],
    ) -> list[list[KVCacheBlock]]:
        """The longest cached prefix of `block_hashes[:max_num_blocks]` that every one of
        `managers` (groups of this attention type) holds: one list of blocks per manager."""
        hits: list[list[KVCacheBlock]] = [[] for _ in managers]
        for block_hash in block_hashes[:max_num_blocks]:
            found = _cached_in_all(managers, block_hash)
            if found is None:
                break
            for group_hits, block in zip(hits, found, strict=True):
                group_hits.append(block)
        return hits


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every query attends to the whole context: every block is kept."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A query at position p attends to keys p - W + 1 .. p: the blocks wholly before the next
    query's first key go back to the pool (still indexed for the prefix cache), and the null
    block takes their place, so a table stays positional (entry i: tokens i * bs ..)."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        window = self.spec.sliding_window
        assert window is not None
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = max(num_computed_tokens - window + 1, 0) // self.block_size
        null = self.pool.null_block
        removed: list[KVCacheBlock] = []
        # Back to front: the freed run ends where an earlier step's (or a prefix hit's) began.
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        self._release(removed)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[bytes],
        max_num_blocks: int,
        managers: list[SingleTypeKVCacheManager],
    ) -> list[list[KVCacheBlock]]:
        """The longest hit whose last `cdiv(W - 1, bs)` blocks are cached: what the first query
        after the hit attends to besides itself. The blocks before them are null. Scans from the
        end; failing a whole window, the leading run of cached blocks is the hit."""
        window = managers[0].spec.sliding_window
        assert window is not None
        bs = managers[0].block_size
        null = managers[0].pool.null_block
        need = cdiv(window - 1, bs)
        hits: list[list[KVCacheBlock]] = [[null] * max_num_blocks for _ in managers]
        if need == 0:  # a window of one token: a query needs no earlier key
            return hits
        run = 0
        for i in range(min(max_num_blocks, len(block_hashes)) - 1, -1, -1):
            found = _cached_in_all(managers, block_hashes[i])
            if found is None:
                run = 0
                continue
            for group_hits, block in zip(hits, found, strict=True):
                group_hits[i] = block
            run += 1
            if run >= need:
                return [group_hits[: i + run] for group_hits in hits]
        # No full window anywhere: the run that starts at block 0 (if any) is the hit.
        return [group_hits[:run] for group_hits in hits]


def _cached_in_all(
    managers: list[SingleTypeKVCacheManager], block_hash: bytes
) -> list[KVCacheBlock] | None:
    found = []
    for m in managers:
        block = m.lookup(block_hash)
        if block is None:
            return None
        found.append(block)
    return found


def make_manager(
    spec: KVCacheGroupSpec, group_id: int, pool: BlockPool, block_size: int
) -> SingleTypeKVCacheManager:
    cls = SlidingWindowManager if spec.frees_outside_window else FullAttentionManager
    return cls(spec, group_id, pool, block_size)
