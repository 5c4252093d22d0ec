"""The hybrid KV cache manager: groups of layers by attention type, a sliding-window group that
gives back what its window left behind, prefix hits held in every group, preemption and
admission counted across groups (issue 39). CPU only: block ids and ref counts, no model.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from stepscope.engine.core.kv_cache_manager import KVCacheManager, cdiv
from stepscope.engine.core.kv_cache_utils import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    KVCacheGroupSpec,
    get_kv_cache_groups,
    kv_cache_layout,
    kv_group_size,
)
from stepscope.engine.core.request import Request, RequestStatus
from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.sampling_params import SamplingParams
from tests.engine.core.fake_runner import fake_runner_output

BS = 16
WINDOW = 512
# Gemma 3 270M: 18 layers, every sixth attends to the whole context.
GEMMA3_270M = tuple(FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(18))


def hybrid_groups(window: int = WINDOW) -> list[KVCacheGroupSpec]:
    return get_kv_cache_groups(GEMMA3_270M, window)


def make_request(req_id: str, prompt: list[int], max_tokens: int = 8, bs: int = BS) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, bs)


def held(kv: KVCacheManager, req_id: str) -> list[int]:
    """Blocks (null ones not counted) the request holds in each group."""
    null = kv.pool.null_block
    return [sum(b is not null for b in g) for g in kv.coordinator.get_blocks(req_id)]


def run_steps(scheduler: Scheduler, steps: int, on_step=None) -> None:
    for _ in range(steps):
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner_output(scheduler, out, 7))
        if on_step is not None:
            on_step(out)


# ---- groups ---------------------------------------------------------------------------------


def test_gemma3_270m_layers_form_one_full_and_five_sliding_groups_of_three() -> None:
    groups = hybrid_groups()

    assert [g.layer_ids for g in groups] == [
        (5, 11, 17),
        (0, 1, 2),
        (3, 4, 6),
        (7, 8, 9),
        (10, 12, 13),
        (14, 15, 16),
    ]
    assert [g.sliding_window for g in groups] == [None] + [WINDOW] * 5
    assert kv_group_size(groups) == 3
    group_of, pair_of = kv_cache_layout(groups, 18)
    assert (group_of[5], pair_of[5]) == (0, 0) and (group_of[17], pair_of[17]) == (0, 2)
    assert (group_of[6], pair_of[6]) == (2, 2) and (group_of[0], pair_of[0]) == (1, 0)


def test_one_attention_type_is_one_group_of_every_layer() -> None:
    (group,) = get_kv_cache_groups((FULL_ATTENTION,) * 4)

    assert group.layer_ids == (0, 1, 2, 3) and group.sliding_window is None


def test_hybrid_switched_off_is_one_group_that_keeps_every_block() -> None:
    (group,) = get_kv_cache_groups(GEMMA3_270M, WINDOW, disable_hybrid=True)

    assert group.layer_ids == tuple(range(18))
    assert not group.frees_outside_window
    kv = KVCacheManager(200, BS, kv_cache_groups=[group])
    request = make_request("r", list(range(1000)))
    kv.allocate_slots(request, 1000)
    request.num_computed_tokens = 1000
    kv.allocate_slots(request, 1)
    assert held(kv, "r") == [cdiv(1001, BS)]
    assert kv.pool.null_block is None


def test_one_type_model_gets_the_same_blocks_as_the_single_table_manager() -> None:
    plain = KVCacheManager(16, 4)
    grouped = KVCacheManager(16, 4, kv_cache_groups=get_kv_cache_groups((FULL_ATTENTION,) * 2))
    for kv in (plain, grouped):
        first = make_request("a", list(range(10)), bs=4)
        kv.allocate_slots(first, 10)
        second = make_request("b", list(range(9)) + [99], bs=4)
        hits, n = kv.get_computed_blocks(second)
        kv.allocate_slots(second, second.num_tokens - n, n, hits)
    assert plain.block_ids("a") == grouped.block_ids("a") == [0, 1, 2]
    assert plain.block_ids("b") == grouped.block_ids("b") == [0, 1, 3]
    assert grouped.pool.null_block is None  # block 0 is a real block


# ---- the sliding window ---------------------------------------------------------------------


def test_sliding_group_frees_blocks_wholly_outside_the_window() -> None:
    window = 8  # two blocks of 4
    groups = get_kv_cache_groups((SLIDING_ATTENTION, FULL_ATTENTION), window)
    kv = KVCacheManager(32, 4, kv_cache_groups=groups)
    null_id = kv.pool.null_block.block_id
    request = make_request("r", list(range(20)), bs=4)
    kv.allocate_slots(request, 20)
    request.num_computed_tokens = 20
    free_before = kv.num_free_blocks

    kv.allocate_slots(request, 1)  # the query at position 20 attends to keys 13 .. 20

    full, sliding = kv.block_ids_by_group("r")
    assert len(full) == len(sliding) == 6
    assert null_id not in full
    # Blocks 0 .. 2 hold tokens 0 .. 11, wholly before key 13; block 3 holds 12 .. 15.
    assert sliding[:3] == [null_id] * 3 and null_id not in sliding[3:]
    # Three blocks back to the pool, two new (one per group) for token 20.
    assert kv.num_free_blocks == free_before + 3 - 2
    assert kv.num_blocks_by_group == [6, 3]


def test_long_request_holds_at_most_a_window_of_blocks_per_sliding_group_while_decoding() -> None:
    kv = KVCacheManager(2000, BS, kv_cache_groups=hybrid_groups())
    scheduler = Scheduler(kv, 512, 4, 4096)
    scheduler.add_request(make_request("long", list(range(2100)), max_tokens=300))
    bound = cdiv(WINDOW, BS) + 1
    decoding_steps = 0
    most = 0

    def check(out) -> None:
        nonlocal decoding_steps, most
        request = scheduler.requests.get("long")
        if request is None or out.num_scheduled_tokens.get("long") != 1:
            return  # finished, or a step of its prefill
        decoding_steps += 1
        full, *sliding = held(kv, "long")
        assert full == cdiv(request.num_computed_tokens, BS)
        assert all(n <= bound for n in sliding), (sliding, bound)
        assert max(sliding) == min(sliding)  # the five sliding groups keep alike
        most = max(most, *sliding)

    run_steps(scheduler, 5 + 300, check)

    assert decoding_steps >= 250 and most == bound  # the bound is reached, never passed
    assert "long" not in scheduler.requests  # finished, every group given back
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert kv.num_blocks_by_group == [0] * 6


# ---- prefix caching -------------------------------------------------------------------------


def test_prefix_hit_holds_in_every_group_with_only_the_window_in_sliding_groups() -> None:
    kv = KVCacheManager(1000, BS, kv_cache_groups=hybrid_groups())
    prompt = list(range(1000, 3000))
    first = make_request("first", prompt)
    kv.allocate_slots(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.free(first)  # every block back in the pool, still indexed

    second = make_request("second", prompt[:1600] + [1, 2, 3])
    hits, num_hit_tokens = kv.get_computed_blocks(second)

    assert num_hit_tokens == 1600
    null = kv.pool.null_block
    full, *sliding = hits.groups
    assert len(full) == 100 and null not in full
    need = cdiv(WINDOW - 1, BS)  # the keys the first query after the hit attends to
    for group in sliding:
        assert len(group) == 100
        assert all(b is null for b in group[: 100 - need])
        assert all(b is not null for b in group[100 - need :])
    assert kv.allocate_slots(second, 3, num_hit_tokens, hits) is not None
    assert held(kv, "second") == [101] + [need + 1] * 5


def test_prefix_hit_shortened_to_what_a_sliding_group_still_holds() -> None:
    kv = KVCacheManager(1000, BS, kv_cache_groups=hybrid_groups())
    prompt = list(range(1000, 2600))  # 100 blocks
    first = make_request("first", prompt)
    kv.allocate_slots(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.free(first)
    # Evict block 90 of one sliding group: its window before block 100 is broken.
    sliding = kv.coordinator.managers[3]
    kv.pool._evict(sliding.lookup(first.block_hashes[90]))

    hits, num_hit_tokens = kv.get_computed_blocks(make_request("again", prompt + [5]))

    # The hit ends where the last whole window before block 90 ends: blocks 58 .. 89.
    assert num_hit_tokens == 90 * BS
    assert all(len(group) == 90 for group in hits.groups)


def test_freed_window_blocks_stay_in_the_prefix_cache() -> None:
    window = 8
    groups = get_kv_cache_groups((SLIDING_ATTENTION, FULL_ATTENTION), window)
    kv = KVCacheManager(64, 4, kv_cache_groups=groups)
    request = make_request("r", list(range(40)), bs=4)
    kv.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    kv.allocate_slots(request, 1)  # frees the sliding group's first blocks
    sliding = kv.coordinator.managers[1]

    assert sliding.lookup(request.block_hashes[0]) is not None
    assert sliding.lookup(request.block_hashes[0]).ref_cnt == 0


# ---- preemption and admission ---------------------------------------------------------------


def test_preemption_frees_the_victim_in_every_group() -> None:
    window = 8
    groups = get_kv_cache_groups((SLIDING_ATTENTION, FULL_ATTENTION), window)
    kv = KVCacheManager(13, 4, kv_cache_groups=groups)  # 12 usable blocks
    scheduler = Scheduler(kv, 64, 4, 64)
    scheduler.add_request(make_request("a", list(range(8)), 40, bs=4))
    scheduler.add_request(make_request("b", list(range(100, 108)), 40, bs=4))
    run_steps(scheduler, 1)
    assert held(kv, "a") == [2, 2] and held(kv, "b") == [2, 2]

    preempted = []
    for _ in range(20):
        out = scheduler.schedule()
        preempted += out.preempted_req_ids
        scheduler.update_from_output(out, fake_runner_output(scheduler, out, 7))
        if preempted:
            break

    assert preempted == ["b"]
    assert held(kv, "b") == [0, 0]
    assert all("b" not in m.req_to_blocks for m in kv.coordinator.managers)


def test_admission_counts_blocks_of_every_group_against_the_free_count() -> None:
    window = 8
    groups = get_kv_cache_groups((SLIDING_ATTENTION, FULL_ATTENTION), window)
    kv = KVCacheManager(12, 4, kv_cache_groups=groups)  # 11 usable blocks
    scheduler = Scheduler(kv, 64, 4, 64)
    scheduler.add_request(make_request("big", list(range(24)), bs=4))  # 6 blocks per group

    out = scheduler.schedule()

    assert out.num_scheduled_tokens == {}
    assert scheduler.last_stats.waiting_reason == "kv_blocks"
    assert scheduler.last_stats.kv_blocks_short == 12 - 11


def test_scheduler_output_carries_each_groups_blocks() -> None:
    window = 8
    groups = get_kv_cache_groups((SLIDING_ATTENTION, FULL_ATTENTION), window)
    kv = KVCacheManager(32, 4, kv_cache_groups=groups)
    scheduler = Scheduler(kv, 64, 4, 64)
    scheduler.add_request(make_request("r", list(range(8)), bs=4))

    first = scheduler.schedule()
    (new,) = first.scheduled_new_reqs
    assert new.block_ids_by_group() == kv.block_ids_by_group("r")
    assert len(new.group_block_ids) == 1
    scheduler.update_from_output(first, fake_runner_output(scheduler, first, 7))
    second = scheduler.schedule()  # position 8 opens a block in both groups
    assert len(second.scheduled_cached_reqs.new_block_ids_by_group(0)) == 2
    assert all(len(ids) == 1 for ids in second.scheduled_cached_reqs.new_block_ids_by_group(0))
    assert scheduler.last_stats.kv_blocks_by_group == (3, 3)


def test_context_fit_counts_every_groups_table_and_the_null_block() -> None:
    from stepscope.engine.core.engine_core import fit_max_model_len

    groups = hybrid_groups()  # six groups

    assert fit_max_model_len(4096, 6 * 128 + 1, BS, None, groups) == 128 * BS
    assert fit_max_model_len(4096, 6 * 128, BS, None, groups) == 127 * BS
    assert fit_max_model_len(4096, 128, BS, None, None) == 128 * BS  # one table, as before
    # Chunks of at most 256 tokens: each of the five sliding groups holds at most the blocks its
    # window and a chunk span, cdiv(511 + 256, 16) + 1 = 49, and the full group the rest.
    assert fit_max_model_len(4096, 6 * 128 + 1, BS, None, groups, max_chunk=256) == 4096
    assert fit_max_model_len(8192, 400 + 5 * 49 + 1, BS, None, groups, max_chunk=256) == 400 * BS
    with pytest.raises(ValueError, match=f"at least {500 + 5 * 49 + 1} "):
        fit_max_model_len(8192, 400 + 5 * 49 + 1, BS, 500 * BS, groups, max_chunk=256)


def test_random_traffic_keeps_ref_counts_and_window_bounds_in_every_group() -> None:
    """Arrivals sharing prefixes, aborts and steps on a small hybrid pool: after each step every
    block's ref count is the number of tables holding it, the free queue holds exactly the
    unheld blocks, the null block is never free or counted, and no decoding request holds more
    than a window of blocks in the sliding group."""
    window, bs = 8, 4
    groups = get_kv_cache_groups((SLIDING_ATTENTION, FULL_ATTENTION), window)
    kv = KVCacheManager(25, bs, kv_cache_groups=groups)  # short: requests get preempted
    scheduler = Scheduler(kv, 16, 4, 48)
    rng = random.Random(0)
    prefix = list(range(500, 520))
    null = kv.pool.null_block
    for i in range(300):
        if rng.random() < 0.3:
            prompt = prefix[: rng.randrange(0, 20)] + [rng.randrange(1000) for _ in range(3)]
            scheduler.add_request(make_request(f"r{i}", prompt, rng.randrange(1, 30), bs=bs))
        if scheduler.running and rng.random() < 0.05:
            victim = rng.choice(scheduler.running).request_id
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner_output(scheduler, out, 7))

        tables = [t for m in kv.coordinator.managers for t in m.req_to_blocks.values()]
        held = Counter(b.block_id for t in tables for b in t if b is not null)
        assert all(b.ref_cnt == held[b.block_id] for b in kv.pool.blocks if b is not null)
        free = {b.block_id for b in kv.pool.free_queue}
        assert free == {b.block_id for b in kv.pool.blocks if b is not null and not b.ref_cnt}
        assert null.ref_cnt == 0 and null.block_id not in free
        assert kv.num_blocks_by_group == [
            len({b.block_id for t in m.req_to_blocks.values() for b in t if b is not null})
            for m in kv.coordinator.managers
        ]
        for req_id, n in out.num_scheduled_tokens.items():
            if n == 1 and req_id in scheduler.requests:
                assert held_in(kv, 1, req_id) <= cdiv(window, bs) + 1
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def held_in(kv: KVCacheManager, group: int, req_id: str) -> int:
    null = kv.pool.null_block
    return sum(b is not null for b in kv.coordinator.get_blocks(req_id)[group])
