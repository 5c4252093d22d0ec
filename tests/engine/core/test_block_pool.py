"""The KV block pool on its own: free queue order, LRU eviction of cached prefixes, ref counts.

CPU only: blocks are ids and counters, no tensors.
"""

from __future__ import annotations

import pytest

from stepscope.engine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from stepscope.engine.core.kv_cache_manager import KVCacheManager
from stepscope.engine.core.request import Request, hash_block
from stepscope.engine.sampling_params import SamplingParams


def free_ids(pool: BlockPool) -> list[int]:
    """Block ids in the free queue, front (evicted first) to back."""
    return [b.block_id for b in pool.free_queue]


def h(i: int) -> bytes:
    """A distinct fake block hash."""
    return hash_block(None, [i])


def take_all(pool: BlockPool) -> list[KVCacheBlock]:
    return pool.get_new_blocks(pool.num_free_blocks)


def test_new_pool_has_every_block_free_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    assert pool.usage == 0.0


def test_pool_without_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_get_new_blocks_pops_from_the_front_with_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert free_ids(pool) == [3]
    assert pool.usage == pytest.approx(0.75)


def test_get_new_blocks_raises_and_takes_nothing_when_short() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [0, 1]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_freed_cached_blocks_are_evicted_oldest_freed_first() -> None:
    pool = BlockPool(4)
    b0, b1, b2 = pool.get_new_blocks(3)
    for i, block in enumerate((b0, b1, b2)):
        pool.cache_block(block, h(i))
    pool.free_blocks([b2])
    pool.free_blocks([b0])
    pool.free_blocks([b1])
    # Block 3 was never used, so it goes first; then the cached ones in the order they were freed.
    assert free_ids(pool) == [3, 2, 0, 1]
    reused = pool.get_new_blocks(4)
    assert [b.block_id for b in reused] == [3, 2, 0, 1]


def test_uncached_freed_blocks_are_reused_before_any_cached_block() -> None:
    pool = BlockPool(4)
    b0, b1, b2, b3 = take_all(pool)
    pool.cache_block(b0, h(0))
    pool.cache_block(b1, h(1))
    pool.free_blocks([b0, b2, b1, b3])
    assert free_ids(pool) == [3, 2, 0, 1]
    first, second = pool.get_new_blocks(2)
    assert {first.block_id, second.block_id} == {2, 3}
    # The cached prefixes survived the two allocations.
    assert pool.lookup(h(0)) is b0 and pool.lookup(h(1)) is b1


def test_reusing_a_cached_block_evicts_it_from_the_prefix_index() -> None:
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h(7))
    pool.free_blocks([block])
    assert pool.lookup(h(7)) is block
    (again,) = pool.get_new_blocks(1)
    assert again is block
    assert block.block_hash is None
    assert pool.lookup(h(7)) is None
    assert pool.cached == {}


def test_touch_takes_a_free_cached_block_out_of_the_middle_of_the_queue() -> None:
    pool = BlockPool(5)
    blocks = take_all(pool)
    pool.cache_block(blocks[2], h(2))
    pool.free_blocks(blocks)  # cached block 2 goes to the back, the rest to the front
    assert free_ids(pool) == [4, 3, 1, 0, 2]
    pool.free_queue.remove(blocks[1])  # now 2 is not at an end any more...
    pool.free_queue.append(blocks[1])
    assert free_ids(pool) == [4, 3, 0, 2, 1]

    pool.touch([blocks[2]])

    assert blocks[2].ref_cnt == 1
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert free_ids(pool) == [4, 3, 0, 1]
    assert pool.num_free_blocks == 4
    # ...and its neighbours now point at each other directly.
    assert blocks[0].next_free is blocks[1] and blocks[1].prev_free is blocks[0]


def test_touch_unlinks_in_constant_time_without_walking_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = BlockPool(1000)
    blocks = take_all(pool)
    pool.cache_block(blocks[500], h(500))
    pool.free_blocks(blocks)

    def no_scan(self: FreeBlockQueue) -> None:
        raise AssertionError("touch must not iterate over the free queue")

    monkeypatch.setattr(FreeBlockQueue, "__iter__", no_scan)
    pool.touch([blocks[500]])
    assert pool.num_free_blocks == 999
    assert blocks[500].ref_cnt == 1


def test_touch_on_a_block_in_use_only_adds_a_reference() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    assert free_ids(pool) == [1, 2]
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [1, 2]  # still held once, so not free
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_ids(pool) == [0, 1, 2]


def test_freeing_a_block_twice_asserts_and_ref_cnt_never_goes_negative() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed more often than taken"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 2


def test_freeing_a_block_never_taken_asserts() -> None:
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.blocks[0]])
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_cache_block_keeps_the_first_copy_of_a_duplicate_hash() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, h(1))
    pool.cache_block(second, h(1))
    assert pool.lookup(h(1)) is first
    assert second.block_hash is None
    # The unindexed copy is plain garbage once freed: it is reused before the cached one.
    pool.free_blocks([first, second])
    assert free_ids(pool) == [1, 0]


def test_cache_block_does_nothing_when_caching_is_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h(1))
    assert block.block_hash is None
    assert pool.lookup(h(1)) is None


def test_reset_prefix_cache_is_refused_while_a_block_is_in_use() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h(3))
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(h(3)) is block
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(h(3)) is None
    assert all(b.block_hash is None for b in pool.blocks)


def test_two_requests_sharing_a_prefix_share_blocks_with_ref_cnt_2() -> None:
    block_size = 4
    kv = KVCacheManager(num_blocks=8, block_size=block_size)
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks
    params = SamplingParams(max_tokens=4)
    first = Request("a", prefix + [1], params, None, block_size)
    second = Request("b", prefix + [2, 3], params, None, block_size)

    assert kv.allocate_slots(first, first.num_tokens) is not None
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 8
    new = kv.allocate_slots(second, second.num_tokens - num_hit_tokens, num_hit_tokens, hits)

    assert new is not None and len(new) == 1
    shared_a, shared_b = kv.req_to_blocks["a"][:2], kv.req_to_blocks["b"][:2]
    assert [b.block_id for b in shared_a] == [b.block_id for b in shared_b]
    assert all(b.ref_cnt == 2 for b in shared_a)
    assert kv.req_to_blocks["a"][2] is not kv.req_to_blocks["b"][2]
    assert kv.num_free_blocks == 8 - 4

    kv.free(first)
    assert all(b.ref_cnt == 1 for b in shared_b)
    assert kv.num_free_blocks == 8 - 3
    kv.free(second)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.num_free_blocks == 8
