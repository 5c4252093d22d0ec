"""KVCacheManager: prefix-cache lookup, `allocate_slots` and freeing (pass 2 of the scheduler).

CPU only: the manager deals in block ids and ref counts.
"""

from __future__ import annotations

import pytest

from stepscope.engine.core.block_pool import KVCacheBlock
from stepscope.engine.core.kv_cache_manager import KVCacheManager
from stepscope.engine.core.request import Request, RequestStatus
from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.sampling_params import SamplingParams
from tests.engine.core.fake_runner import fake_runner_output

BS = 4  # block size of most tests here: small, so block arithmetic is easy to follow


def make_request(
    req_id: str, prompt: list[int], *, block_size: int = BS, max_tokens: int = 8
) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, block_size)


def admit(kv: KVCacheManager, request: Request) -> list[KVCacheBlock]:
    """Do what pass 2 of the scheduler does for one waiting request; fail if it does not fit."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return new


def pool_snapshot(kv: KVCacheManager) -> tuple[object, ...]:
    pool = kv.pool
    return (
        [b.block_id for b in pool.free_queue],
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        dict(pool.cached),
        {k: list(v) for k, v in kv.req_to_blocks.items()},
        dict(kv.num_cached_blocks),
    )


# ---- get_computed_blocks ---------------------------------------------------------------------


def test_prompt_of_exactly_two_full_blocks_hits_at_most_one_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 100 + 2 * BS))
    admit(kv, make_request("first", prompt))
    assert len(kv.pool.cached) == 2  # both blocks of the first request are indexed

    hits, num_hit_tokens = kv.get_computed_blocks(make_request("same", prompt))

    # The last prompt token must run through the model, so its block cannot be a hit.
    assert len(hits) == 1
    assert num_hit_tokens == BS


def test_prompt_one_token_past_two_full_blocks_hits_both() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 100 + 2 * BS))
    admit(kv, make_request("first", prompt))

    hits, num_hit_tokens = kv.get_computed_blocks(make_request("longer", prompt + [7]))

    assert [b.block_id for b in hits] == kv.block_ids("first")
    assert num_hit_tokens == 2 * BS


def test_prefix_hit_stops_at_the_first_block_that_differs() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 100 + 3 * BS))
    admit(kv, make_request("first", prompt + [1]))
    changed = prompt[:BS] + [999] + prompt[BS + 1 :] + [1]

    hits, num_hit_tokens = kv.get_computed_blocks(make_request("changed", changed))

    # Block hashes are chained, so the third block misses too although its tokens are equal.
    assert num_hit_tokens == BS
    assert hits == kv.req_to_blocks["first"][:1]


def test_prefix_lookup_counts_queried_and_hit_tokens_once_per_admission() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    prompt = list(range(100, 100 + 2 * BS))
    scheduler.add_request(make_request("first", prompt + [1]))  # 9 tokens queried, 0 hit
    scheduler.schedule()
    assert (kv.prefix_queries, kv.prefix_hits) == (2 * BS + 1, 0)

    # Needs 3 blocks, 1 is free: blocked at the head of the queue for two steps, counted never.
    scheduler.add_request(make_request("second", list(range(500, 500 + 2 * BS + 2))))
    scheduler.schedule()
    scheduler.schedule()
    assert (kv.prefix_queries, kv.prefix_hits) == (2 * BS + 1, 0)

    scheduler.finish_requests(["first", "second"], RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("third", prompt + [2, 3]))  # 10 queried, 8 hit
    scheduler.schedule()
    assert (kv.prefix_queries, kv.prefix_hits) == (2 * (2 * BS + 1) + 1, 2 * BS)


def test_nothing_is_looked_up_or_counted_with_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    prompt = list(range(100, 100 + 2 * BS))
    admit(kv, make_request("first", prompt + [1]))

    assert kv.get_computed_blocks(make_request("second", prompt + [2])) == ([], 0)
    assert kv.pool.cached == {}
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)


def test_admitted_request_records_its_prefix_hit_tokens() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128)
    prefix = list(range(100, 100 + 2 * BS))
    first = make_request("first", prefix + [1])
    scheduler.add_request(first)
    assert first.num_cached_tokens == -1  # not admitted yet
    scheduler.schedule()
    assert first.num_cached_tokens == 0

    second = make_request("second", prefix + [2, 3])
    scheduler.add_request(second)
    out = scheduler.schedule()

    assert second.num_cached_tokens == 2 * BS
    assert out.num_scheduled_tokens["second"] == 2  # only the two tokens past the hit
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * BS
    assert scheduler.last_stats.prefix_hit_tokens == 2 * BS
    assert kv.block_ids("second")[:2] == kv.block_ids("first")[:2]
    outputs = scheduler.update_from_output(out, fake_runner_output(scheduler, out, token=5))
    reported = {o.request_id: o.num_cached_tokens for o in outputs}
    assert reported["second"] == 2 * BS


# ---- allocate_slots --------------------------------------------------------------------------


def test_allocate_slots_returns_none_and_changes_nothing_when_short() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    holder = make_request("holder", list(range(100, 100 + BS + 1)))
    admit(kv, holder)  # 2 blocks, one of them cached
    before = pool_snapshot(kv)

    too_big = make_request("too_big", list(range(200, 200 + 3 * BS)))
    assert kv.allocate_slots(too_big, too_big.num_tokens) is None

    assert pool_snapshot(kv) == before
    assert "too_big" not in kv.req_to_blocks
    assert kv.num_free_blocks == 2


def test_allocate_slots_for_a_running_request_changes_nothing_when_short() -> None:
    kv = KVCacheManager(num_blocks=1, block_size=BS)
    request = make_request("r", list(range(100, 100 + BS)))
    admit(kv, request)
    request.append_output_token(1)
    before = pool_snapshot(kv)

    assert kv.allocate_slots(request, 1) is None  # its 5th token needs a second block

    assert pool_snapshot(kv) == before
    assert kv.block_ids("r") == [0]


def test_prefix_hits_waiting_in_the_free_queue_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    prefix = list(range(100, 100 + 2 * BS))
    first = make_request("first", prefix + [1])
    admit(kv, first)
    kv.free(first)  # all 3 free, 2 of them still cached
    second = make_request("second", prefix + list(range(300, 300 + BS + 1)))
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert len(hits) == 2
    before = pool_snapshot(kv)

    # 2 hits + 2 new blocks = 4 > 3: the hits cannot also be handed out as new blocks.
    assert (
        kv.allocate_slots(second, second.num_tokens - num_hit_tokens, num_hit_tokens, hits) is None
    )

    assert pool_snapshot(kv) == before
    assert all(b.ref_cnt == 0 for b in hits)


def test_allocate_slots_takes_free_prefix_hits_out_of_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prefix = list(range(100, 100 + 2 * BS))
    first = make_request("first", prefix + [1])
    admit(kv, first)
    kv.free(first)
    second = make_request("second", prefix + [2])

    new = admit(kv, second)

    assert len(new) == 1
    held = kv.req_to_blocks["second"]
    assert all(b.ref_cnt == 1 for b in held)
    assert not {b.block_id for b in held} & {b.block_id for b in kv.pool.free_queue}
    assert kv.num_free_blocks == 1


def test_allocate_slots_adds_blocks_only_when_a_token_crosses_a_block_boundary() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    request = make_request("r", list(range(100, 100 + BS - 1)))
    assert len(admit(kv, request)) == 1
    request.append_output_token(1)
    assert kv.allocate_slots(request, 1) == []  # 4th token still fits in block 0
    request.num_computed_tokens += 1
    request.append_output_token(2)
    new = kv.allocate_slots(request, 1)  # 5th token opens block 1
    assert new is not None and len(new) == 1
    assert kv.block_ids("r") == [0, new[0].block_id]


def test_allocate_slots_indexes_only_blocks_filled_by_the_allocation() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("r", list(range(100, 100 + 3 * BS)))
    kv.allocate_slots(request, BS + 2)  # a first chunk: one full block and half of the next
    assert len(kv.pool.cached) == 1
    assert kv.req_to_blocks["r"][0].block_hash == request.block_hashes[0]
    assert kv.req_to_blocks["r"][1].block_hash is None


def test_allocate_slots_rejects_a_non_positive_token_count() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    with pytest.raises(ValueError, match="positive"):
        kv.allocate_slots(make_request("r", [1, 2]), 0)


# ---- free --------------------------------------------------------------------------------------


def test_free_releases_the_tail_first_so_the_prefix_stays_cached_longest() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    request = make_request("r", list(range(100, 100 + 3 * BS)))
    admit(kv, request)  # 3 full blocks, all cached
    ids = kv.block_ids("r")

    kv.free(request)

    assert [b.block_id for b in kv.pool.free_queue] == ids[::-1]
    assert "r" not in kv.req_to_blocks and "r" not in kv.num_cached_blocks


def test_freeing_an_unknown_request_does_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    kv.free(make_request("ghost", [1]))
    assert kv.num_free_blocks == 2


@pytest.mark.parametrize("enable_caching", [True, False])
def test_every_block_is_free_after_all_requests_finish_or_are_aborted(
    enable_caching: bool,
) -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_caching=enable_caching)
    scheduler = Scheduler(kv, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    prefix = list(range(100, 100 + 2 * BS))
    for i in range(6):
        prompt = prefix + [i] * (i + 1) if i % 2 else list(range(200 + 20 * i, 209 + 20 * i))
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=3 + i))
    aborted = False
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner_output(scheduler, out, token=9))
        if not aborted and scheduler.step_index == 3:
            # One running request, one waiting request and one unknown id.
            assert scheduler.running and scheduler.waiting
            victims = [scheduler.running[0].request_id, scheduler.waiting[0].request_id, "nobody"]
            scheduler.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
            aborted = True
    assert aborted
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.req_to_blocks == {}
