"""The scheduler simulator: the real Scheduler answers the budget walkthrough's two worked
examples and agrees with the budget and block arithmetic; over many steps it shows what one step
cannot."""

from __future__ import annotations

import itertools
import math
import time

import pytest

from stepscope.viz.simulator import (
    GEMMA3_LAYERS,
    GROUP_A,
    GROUP_B,
    LAYER_PATTERNS,
    MAX_CHUNK_STEPS,
    WALKTHROUGH_SETTINGS,
    simulate_step,
    simulate_steps,
)


def test_group_a_is_admitted_with_31_of_64_free_blocks():
    r = simulate_step(**GROUP_A, **WALKTHROUGH_SETTINGS)
    assert (r.decode_tokens, r.prefill_budget, r.first_chunk) == (64, 1984, 1984)
    assert (r.num_chunks, r.first_chunk_blocks) == (2, 31)
    assert r.admitted and r.blocks_short == 0 and not r.blocked_by_max_seqs
    assert r.kv_free_after == 64 - 31
    assert r.decodes_new_block == 0 and r.preempted == ()
    assert r.verdict == "admitted"


def test_group_b_is_short_by_14_blocks():
    r = simulate_step(**GROUP_B, **WALKTHROUGH_SETTINGS)
    assert (r.decode_tokens, r.prefill_budget, r.first_chunk) == (127, 1921, 1920)
    assert (r.num_chunks, r.first_chunk_blocks) == (1, 30)
    assert not r.admitted and r.blocks_short == 14 and not r.blocked_by_max_seqs
    assert r.kv_free_after == 16  # nothing was taken: allocate_slots changed nothing
    assert r.verdict == "not admitted: short by 14 blocks"


def test_group_b_gets_in_with_exactly_the_14_blocks_it_lacks():
    admitted = {
        extra: "p0"
        in simulate_steps(**{**GROUP_B, "free_blocks": 16 + extra}, num_steps=1)[0].scheduled
        for extra in (13, 14)
    }
    assert admitted == {13: False, 14: True}


def test_group_a_is_refused_when_every_decode_crosses_a_block_boundary():
    r = simulate_step(**GROUP_A, **WALKTHROUGH_SETTINGS, decodes_crossing=64)
    assert r.decode_tokens == 64 and r.decodes_new_block == 64  # one new block each
    assert r.kv_free_after == 0 and r.preempted == ()
    assert not r.admitted and r.first_chunk_blocks == 31 and r.blocks_short == 31
    assert r.verdict == "not admitted: short by 31 blocks"


@pytest.mark.parametrize("crossing", [0, 1, 32, 33, 34, 63, 64])
def test_group_a_admitted_while_crossing_decodes_leave_31_blocks(crossing):
    r = simulate_step(**GROUP_A, **WALKTHROUGH_SETTINGS, decodes_crossing=crossing)
    assert r.decodes_new_block == crossing
    assert r.admitted == (64 - crossing >= 31)
    assert r.blocks_short == max(31 - (64 - crossing), 0)


def test_crossing_decodes_beyond_the_free_blocks_preempt_and_stop_admission():
    # 4 decodes each need a new block and 2 are free: the last running request is preempted
    # (which frees its block for another decode), and nothing is admitted in such a step.
    r = simulate_step(running=4, prompt_len=8, free_blocks=2, block_size=16, decodes_crossing=4)
    assert r.preempted == ("d3",) and r.decode_tokens == 3
    assert not r.admitted and r.verdict == "not admitted: the step preempted d3"


def test_defaults_are_the_walkthrough_settings():
    assert simulate_step(**GROUP_A) == simulate_step(**GROUP_A, **WALKTHROUGH_SETTINGS)


def test_num_chunks_counts_the_steps_simulate_steps_takes():
    kw = dict(running=8, prompt_len=300, free_blocks=100, budget=64, block_size=16)
    steps = simulate_steps(**kw, num_steps=10, output_len=2)
    chunks = [s.scheduled["p0"] for s in steps if s.scheduled.get("p0", 0) > 1]
    assert sum(chunks) == 300
    assert simulate_step(**kw).num_chunks == len(chunks) == 6


def test_num_chunks_is_none_past_the_step_limit():
    # 99 decodes leave 1 token a step: the prompt would need 200 steps.
    r = simulate_step(running=99, prompt_len=200, free_blocks=300, budget=100, block_size=16)
    assert r.prefill_budget == 1 and r.admitted and MAX_CHUNK_STEPS < 200
    assert r.num_chunks is None


STATES = list(
    itertools.product(
        [0, 1, 64, 127, 255, 256, 600],  # running
        [1, 64, 65, 1920, 3968],  # prompt_len
        [0, 16, 31, 64],  # free_blocks
    )
)


@pytest.mark.parametrize(
    "budget,block_size,max_num_seqs", [(2048, 64, 256), (512, 16, 128), (100, 32, 256)]
)
def test_real_scheduler_agrees_with_budget_and_block_arithmetic(budget, block_size, max_num_seqs):
    for running, prompt_len, free_blocks in STATES:
        r = simulate_step(running, prompt_len, free_blocks, budget, block_size, max_num_seqs)
        decode = min(running, budget)
        prefill_budget = budget - decode
        first_chunk = min(prompt_len, prefill_budget)
        blocks = math.ceil(first_chunk / block_size)
        admitted = prefill_budget > 0 and blocks <= free_blocks and running < max_num_seqs
        case = (running, prompt_len, free_blocks)
        assert r.decode_tokens == decode, case
        assert r.prefill_budget == prefill_budget, case
        assert r.first_chunk == first_chunk, case
        assert r.first_chunk_blocks == blocks, case
        assert r.num_chunks == (math.ceil(prompt_len / prefill_budget) if prefill_budget else None)
        assert r.admitted == admitted, case
        assert r.blocks_short == (0 if admitted else max(blocks - free_blocks, 0)), case
        assert r.blocked_by_max_seqs == (not admitted and running >= max_num_seqs), case
        assert r.kv_free_after == free_blocks - (blocks if admitted else 0), case


def test_full_max_num_seqs_blocks_admission_even_with_blocks_to_spare():
    r = simulate_step(running=256, prompt_len=64, free_blocks=100)
    assert not r.admitted and r.blocked_by_max_seqs and r.blocks_short == 0
    assert r.verdict == "not admitted: max_num_seqs (256) reached"


def test_decodes_filling_the_budget_leave_nothing_for_prefill():
    r = simulate_step(running=3000, prompt_len=10, free_blocks=10, max_num_seqs=4096)
    assert r.decode_tokens == 2048 and r.prefill_budget == 0 and r.num_chunks is None
    assert not r.admitted and r.verdict == "not admitted: no token budget left"


def test_bad_settings_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        simulate_step(1, 10, 10, block_size=1)
    with pytest.raises(ValueError, match="prompt_len"):
        simulate_step(1, 0, 10)
    with pytest.raises(ValueError, match="free_blocks"):
        simulate_step(1, 10, -1)
    with pytest.raises(ValueError, match="decodes_crossing"):
        simulate_step(2, 10, 10, decodes_crossing=3)


def test_simulate_step_is_fast_enough_for_a_slider():
    simulate_step(256, 8192, 512)  # warm
    start = time.perf_counter()
    for _ in range(5):
        simulate_step(256, 8192, 512)
    assert (time.perf_counter() - start) / 5 < 0.25


# ---- many steps ---------------------------------------------------------------------------------
# Four running requests of 480-token prompts in 36 free blocks of 16, under a 128-token budget.
SMALL_POOL = dict(running=4, prompt_len=480, free_blocks=36, budget=128, block_size=16,
                  num_steps=24, output_len=16)  # fmt: skip


def _first_output_step(steps, rid):
    """The step at which `rid` finished its (first) prefill: its scheduled tokens reached the
    prompt."""
    total = 0
    for s in steps:
        total += s.scheduled.get(rid, 0)
        if total >= SMALL_POOL["prompt_len"]:
            return s.step
    return None


def test_long_prompt_is_prefilled_in_chunks_over_several_steps():
    steps = simulate_steps(**SMALL_POOL)
    chunks = [s.scheduled["p0"] for s in steps[:5] if s.scheduled.get("p0", 0) > 1]
    assert len(chunks) >= 3
    assert sum(chunks) == 480
    # Each chunk is what the budget leaves after the running decodes.
    for s in steps[: len(chunks) - 1]:
        assert s.scheduled["p0"] == 128 - s.decode_tokens


def test_second_request_with_the_same_prompt_hits_the_prefix_cache():
    steps = simulate_steps(**SMALL_POOL, repeat_prompt_at=4)
    arrival = steps[4]
    assert arrival.arrived == ("p1",)
    assert arrival.prefix_hit_tokens > 0 and arrival.prefix_hit_tokens % 16 == 0
    # Only the tokens past the cached blocks are computed.
    assert arrival.scheduled["p1"] == min(480 - arrival.prefix_hit_tokens, 128)
    without = simulate_steps(**SMALL_POOL, repeat_prompt_at=4, prefix_caching=False)
    assert all(s.prefix_hit_tokens == 0 for s in without)


def test_preemption_when_blocks_run_out_then_recompute():
    steps = simulate_steps(**SMALL_POOL, repeat_prompt_at=4)
    preempted = [(s.step, rid) for s in steps for rid in s.preempted]
    assert preempted, "the small pool must run dry"
    step, rid = preempted[0]
    assert steps[step].kv_free_before <= 1
    later = [s for s in steps[step + 1 :] if s.scheduled.get(rid, 0) > 1]
    assert later, f"{rid} is recomputed after its preemption"
    assert later[0].prefix_hit_tokens > 0  # its freed blocks were still in the prefix cache


def test_decodes_cross_into_new_blocks():
    steps = simulate_steps(running=32, prompt_len=64, free_blocks=64, block_size=16, num_steps=20)
    crossings = [s for s in steps if s.decodes_new_block]
    assert len(crossings) >= 10
    for s in crossings:
        if not s.arrived and not s.preempted and s.prefill_tokens == 0:
            assert s.kv_free_before - s.kv_free_after == s.decodes_new_block


def test_finished_requests_free_their_blocks():
    steps = simulate_steps(
        running=2, prompt_len=40, free_blocks=20, block_size=16, num_steps=10, output_len=3
    )
    done = [s for s in steps if "p0" in s.finished]
    assert len(done) == 1
    after = steps[done[0].step + 1]
    assert after.kv_free_before > done[0].kv_free_after


GEMMA3 = dict(layer_types=GEMMA3_LAYERS, sliding_window=512)
# A 2,000-token prompt chunked by a 256-token budget, then decoding, beside two running decodes.
HYBRID_RUN = dict(
    running=2, prompt_len=2000, free_blocks=800, budget=256, block_size=32, num_steps=40,
    output_len=32, repeat_prompt_at=12,
)  # fmt: skip


def test_gemma3_pattern_is_one_full_attention_group_and_five_sliding_window_groups():
    assert LAYER_PATTERNS["Gemma 3: 5 local : 1 global, window 512"] == (GEMMA3_LAYERS, 512)
    steps = simulate_steps(**HYBRID_RUN, **GEMMA3)
    assert all(s.kv_group_windows == (0, 512, 512, 512, 512, 512) for s in steps)
    assert all(len(s.kv_blocks_by_group) == 6 for s in steps)


def test_sliding_window_groups_stay_within_the_window_while_full_attention_grows():
    steps = simulate_steps(**HYBRID_RUN, **GEMMA3)
    window_blocks = math.ceil(512 / 32) + 1
    decoding = [s for s in steps if s.prefill_tokens == 0]
    assert len(decoding) >= 10, "the prompts must be prefilled well before the run ends"
    for s in decoding:
        for held in s.kv_blocks_by_group[1:]:
            assert held <= window_blocks * s.num_running, s
    full = [s.kv_blocks_by_group[0] for s in steps]
    # The full-attention group keeps every block of the 2,000-token prompt; a window keeps a
    # fraction of it.
    assert full[-1] >= math.ceil(2000 / 32) and full[-1] > 2 * full[0]
    assert max(s.kv_blocks_by_group[1] for s in decoding) < full[-1] / 2
    # The groups' blocks are the pool's used blocks (the null block aside).
    for s in steps:
        assert sum(s.kv_blocks_by_group) == 2 * 6 + 800 - s.kv_free_after


def test_all_full_attention_is_the_one_group_simulator_of_before():
    default = simulate_steps(**HYBRID_RUN)
    assert default == simulate_steps(**HYBRID_RUN, layer_types=("full_attention",) * 4)
    assert all(len(s.kv_blocks_by_group) == 1 and s.kv_group_windows == (0,) for s in default)
    assert simulate_step(**GROUP_A) == simulate_step(**GROUP_A, layer_types=None)


def test_one_hybrid_step_takes_the_first_chunks_blocks_in_every_group():
    r = simulate_step(running=4, prompt_len=1000, free_blocks=200, budget=256, block_size=32,
                      **GEMMA3)  # fmt: skip
    assert r.admitted and r.first_chunk == 252
    assert r.first_chunk_blocks == 6 * math.ceil(252 / 32)
    # Four decodes hold one block in each group; the prompt its first chunk's.
    assert r.kv_blocks_by_group == (4 + 8,) * 6
    assert r.kv_free_after == 200 - r.first_chunk_blocks
