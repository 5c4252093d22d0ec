"""The KV block pool: fixed-size blocks, a free queue and the prefix-cache index (stage 4).

Engine-core side only: blocks are ids and ref counts, never tensors. The worker owns the memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and its tokens are known; the key into the prefix cache.
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the front, append, and removal from the
    middle (a cached block that a new request hits leaves the queue without a scan).

    The front is evicted first. Freed blocks that hold a cached prefix go to the back, so the least
    recently used prefix is evicted first; freed blocks with nothing cached go to the front, so
    they are reused before any cached prefix is given up.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link(block, self._head, self._head.next_free)

    def _link(self, block: KVCacheBlock, before: KVCacheBlock, after: KVCacheBlock) -> None:
        block.prev_free, block.next_free = before, after
        before.next_free = block
        after.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """`reserve_null_block`: block 0 leaves the pool for good, as the null block a sliding-window
    group's table holds where its window has freed a block (zeroed, never written, never freed;
    taken only where some group frees blocks, so single-table engines keep every block id)."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False
    ) -> None:
        if num_blocks < 1 + reserve_null_block:
            least = "two blocks (one is the null block)" if reserve_null_block else "one block"
            raise ValueError(f"the KV pool needs at least {least}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.free_queue.popleft()

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits; a hit that was free leaves the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (evicted first goes first)."""
        for block in blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        if block_hash in self.cached:
            # Another request computed the same tokens first; keep the first copy indexed.
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
