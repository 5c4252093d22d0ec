"""The scheduler with the real KVCacheManager: one token budget per step (stage 3).

Each step is `schedule()` then `update_from_output()` with a fake ModelRunnerOutput, so no model
and no tensors are needed.
"""

from __future__ import annotations

import pytest

from stepscope.engine.core.kv_cache_manager import KVCacheManager, cdiv
from stepscope.engine.core.request import Request, RequestStatus
from stepscope.engine.core.scheduler import Scheduler
from stepscope.engine.messages import EngineCoreOutput, SchedulerOutput
from stepscope.engine.sampling_params import SamplingParams
from tests.engine.core.fake_runner import fake_runner_output

BS = 4  # block size of the small hand-checked cases
EOS = 0


def tokens(n: int, start: int = 1000) -> list[int]:
    """`n` prompt tokens that share nothing with a prompt started 1000 ids away."""
    return list(range(start, start + n))


def make_request(
    req_id: str,
    prompt: list[int],
    *,
    block_size: int = BS,
    eos_token_id: int | None = EOS,
    **params: object,
) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(req_id, prompt, SamplingParams(**params), eos_token_id, block_size)


def make_scheduler(
    num_blocks: int,
    *,
    block_size: int = BS,
    budget: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_caching: bool = False,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching)
    return Scheduler(kv, budget, max_num_seqs, max_model_len, enable_chunked_prefill)


def step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, fake_runner_output(scheduler, out, token))


def output_of(outputs: list[EngineCoreOutput], req_id: str) -> EngineCoreOutput:
    (found,) = [o for o in outputs if o.request_id == req_id]
    return found


# ---- the budget walkthrough (docs/request-path.md, section 4): budget 2048, block size 64 -------

WALKTHROUGH_BUDGET = 2048
WALKTHROUGH_BLOCK_SIZE = 64
WALKTHROUGH_MAX_NUM_SEQS = 256


def walkthrough_scenario(num_running: int, free_blocks: int) -> Scheduler:
    """`num_running` requests decoding, each inside its one block, and `free_blocks` free."""
    scheduler = make_scheduler(
        num_running + free_blocks,
        block_size=WALKTHROUGH_BLOCK_SIZE,
        budget=WALKTHROUGH_BUDGET,
        max_num_seqs=WALKTHROUGH_MAX_NUM_SEQS,
        max_model_len=8192,
    )
    for i in range(num_running):
        # 10 prompt tokens: the prefill and the next 54 decodes all fit in one 64-token block,
        # which is the walkthrough's model of a decode (1 token, no new block).
        request = make_request(
            f"decode{i}", tokens(10, start=100 * i), block_size=WALKTHROUGH_BLOCK_SIZE
        )
        scheduler.add_request(request)
    out, outputs = step(scheduler)
    assert len(out.scheduled_new_reqs) == num_running
    assert len(outputs) == num_running
    for request in scheduler.running:
        assert request.num_computed_tokens == request.num_tokens - 1  # decoding from here on
    assert scheduler.kv.num_free_blocks == free_blocks
    return scheduler


def walkthrough_prompt(scheduler: Scheduler, prompt_len: int) -> Request:
    """The walkthrough's new prompt, request id "prompt", queued behind the running decodes."""
    prompt = make_request("prompt", tokens(prompt_len, 10**6), block_size=WALKTHROUGH_BLOCK_SIZE)
    scheduler.add_request(prompt)
    return prompt


def test_walkthrough_group_a_prompt_admitted_beside_64_decodes_and_finished_in_two_chunks() -> None:
    scheduler = walkthrough_scenario(num_running=64, free_blocks=64)
    kv = scheduler.kv
    prompt = walkthrough_prompt(scheduler, 3968)

    out = scheduler.schedule()

    decodes = {r: n for r, n in out.num_scheduled_tokens.items() if r != "prompt"}
    assert len(decodes) == 64 and set(decodes.values()) == {1}
    prefill_budget = WALKTHROUGH_BUDGET - len(decodes)
    assert prefill_budget == 1984
    assert out.num_scheduled_tokens["prompt"] == 1984  # the first chunk takes all of it
    assert out.total_num_scheduled_tokens == WALKTHROUGH_BUDGET
    assert cdiv(1984, WALKTHROUGH_BLOCK_SIZE) == 31
    assert len(kv.block_ids("prompt")) == 31  # 31 <= 64: admitted
    assert kv.num_free_blocks == 64 - 31
    assert [r.req_id for r in out.scheduled_new_reqs] == ["prompt"]
    stats = scheduler.last_stats
    assert (stats.num_decode_tokens, stats.num_prefill_tokens) == (64, 1984)
    assert (stats.kv_free_before, stats.kv_free_after) == (64, 33)

    outputs = scheduler.update_from_output(out, fake_runner_output(scheduler, out, token=7))
    assert "prompt" not in {o.request_id for o in outputs}  # mid-prefill: nothing sampled

    out = scheduler.schedule()  # second and last chunk, again beside the 64 decodes

    assert out.num_scheduled_tokens["prompt"] == 3968 - 1984
    assert out.total_num_scheduled_tokens == WALKTHROUGH_BUDGET
    assert out.scheduled_new_reqs == []
    assert prompt.num_computed_tokens == prompt.num_tokens == 3968
    assert len(kv.block_ids("prompt")) == 62
    outputs = scheduler.update_from_output(out, fake_runner_output(scheduler, out, token=7))
    assert output_of(outputs, "prompt").new_token_ids == [7]  # 2 chunks, then the first token


def test_walkthrough_group_b_prompt_not_admitted_when_blocks_short() -> None:
    scheduler = walkthrough_scenario(num_running=127, free_blocks=16)
    kv = scheduler.kv
    prompt = walkthrough_prompt(scheduler, 1920)

    out = scheduler.schedule()

    assert len(out.num_scheduled_tokens) == 127
    assert set(out.num_scheduled_tokens.values()) == {1}
    budget_left = WALKTHROUGH_BUDGET - out.total_num_scheduled_tokens
    assert budget_left == 1921
    first_chunk = min(prompt.num_tokens, budget_left)
    assert first_chunk == 1920  # the whole prompt would be one chunk
    blocks_needed = cdiv(first_chunk, WALKTHROUGH_BLOCK_SIZE)
    assert blocks_needed == 30
    assert blocks_needed - kv.num_free_blocks == 14  # short by 14: not admitted
    assert "prompt" not in out.num_scheduled_tokens
    assert list(scheduler.waiting) == [prompt]
    assert prompt.status == RequestStatus.WAITING
    assert prompt.num_computed_tokens == 0
    assert "prompt" not in kv.req_to_blocks
    assert kv.num_free_blocks == 16
    assert scheduler.last_stats.num_prefill_tokens == 0


def test_walkthrough_group_b_prompt_admitted_once_30_blocks_are_free() -> None:
    scheduler = walkthrough_scenario(num_running=127, free_blocks=30)
    walkthrough_prompt(scheduler, 1920)

    out = scheduler.schedule()

    assert out.num_scheduled_tokens["prompt"] == 1920
    assert out.total_num_scheduled_tokens == 127 + 1920
    assert scheduler.kv.num_free_blocks == 0


# ---- budget and admission ------------------------------------------------------------------------


def test_chunked_prefill_shares_each_step_with_decodes() -> None:
    scheduler = make_scheduler(16, budget=8)
    scheduler.add_request(make_request("chat", tokens(3)))
    step(scheduler)
    scheduler.add_request(make_request("long", tokens(20, start=2000)))

    chunks = []
    sampled_long = []
    while not sampled_long:
        out, outputs = step(scheduler)
        assert out.num_scheduled_tokens["chat"] == 1  # the decode runs in every step
        assert out.total_num_scheduled_tokens <= 8
        chunks.append(out.num_scheduled_tokens["long"])
        sampled_long = [o for o in outputs if o.request_id == "long"]
    assert chunks == [7, 7, 6]


def test_later_chunks_reach_the_worker_as_cached_diffs_with_new_blocks() -> None:
    scheduler = make_scheduler(16, budget=6)
    scheduler.add_request(make_request("long", tokens(14)))

    out, _ = step(scheduler)
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[0, 1]]
    out, _ = step(scheduler)
    cached = out.scheduled_cached_reqs
    assert out.scheduled_new_reqs == []
    assert (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens) == (
        ["long"],
        [[2]],
        [6],
    )


def test_prefill_is_not_chunked_when_chunking_is_disabled() -> None:
    scheduler = make_scheduler(16, budget=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("chat", tokens(3), max_tokens=2))
    step(scheduler)
    scheduler.add_request(make_request("long", tokens(8, start=2000)))

    out, _ = step(scheduler)  # 1 decode + 8 prompt tokens > 8: the prompt must wait whole
    assert out.num_scheduled_tokens == {"chat": 1}
    assert [r.request_id for r in scheduler.waiting] == ["long"]
    assert "chat" not in scheduler.requests  # its second token was its last

    out, _ = step(scheduler)  # the whole budget is free now, so the prompt fits whole
    assert out.num_scheduled_tokens == {"long": 8}


def test_max_num_seqs_stops_admission() -> None:
    scheduler = make_scheduler(16, max_num_seqs=2)
    scheduler.add_request(make_request("a", tokens(2), max_tokens=1))
    scheduler.add_request(make_request("b", tokens(2, 2000)))
    scheduler.add_request(make_request("c", tokens(2, 3000)))

    out, _ = step(scheduler)  # "a" finishes on its one token

    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    out, _ = step(scheduler)
    assert set(out.num_scheduled_tokens) == {"b", "c"}
    assert len(scheduler.running) == 2


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    scheduler = make_scheduler(16, budget=4)
    scheduler.add_request(make_request("first", tokens(10)))
    step(scheduler)
    scheduler.add_request(make_request("second", tokens(2, 2000)))

    out, _ = step(scheduler)  # the running prefill takes the whole budget

    assert out.num_scheduled_tokens == {"first": 4}
    assert [r.request_id for r in scheduler.waiting] == ["second"]
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens.items()) == [("first", 2), ("second", 2)]


def test_waiting_head_that_does_not_fit_holds_back_later_arrivals() -> None:
    scheduler = make_scheduler(4)
    scheduler.add_request(make_request("huge", tokens(20)))  # needs 5 blocks of 4
    scheduler.add_request(make_request("tiny", tokens(2, 2000)))

    out = scheduler.schedule()

    assert out.num_scheduled_tokens == {}
    assert [r.request_id for r in scheduler.waiting] == ["huge", "tiny"]
    assert scheduler.kv.num_free_blocks == 4


def test_adding_a_request_id_twice_is_refused() -> None:
    scheduler = make_scheduler(4)
    scheduler.add_request(make_request("r", tokens(2)))
    with pytest.raises(ValueError, match="already in the engine"):
        scheduler.add_request(make_request("r", tokens(2)))


# ---- preemption --------------------------------------------------------------------------------


def test_preemption_victim_is_the_last_admitted_running_request() -> None:
    scheduler = make_scheduler(2)
    scheduler.add_request(make_request("old", tokens(4)))  # its decode opens a second block
    scheduler.add_request(make_request("new", tokens(2, 2000)))  # its decode fits its block
    step(scheduler)
    scheduler.add_request(make_request("later", tokens(2, 3000)))
    new = scheduler.requests["new"]
    assert new.num_computed_tokens == 2

    out = scheduler.schedule()

    assert out.preempted_req_ids == ["new"]
    assert out.num_scheduled_tokens == {"old": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [[1]]  # the victim's block, reused
    assert [r.request_id for r in scheduler.running] == ["old"]
    assert [r.request_id for r in scheduler.waiting] == ["new", "later"]  # head of waiting
    assert new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and len(new.events.preempted) == 1
    assert new.output_token_ids == [7]  # generated tokens are kept, to be recomputed
    assert "new" not in scheduler.kv.req_to_blocks
    assert scheduler.num_preemptions == 1
    assert scheduler.last_stats.preempted == ("new",)


def test_request_needing_a_block_preempts_itself_when_it_was_admitted_last() -> None:
    scheduler = make_scheduler(2)
    scheduler.add_request(make_request("old", tokens(2)))
    scheduler.add_request(make_request("new", tokens(4, 2000)))
    step(scheduler)

    out = scheduler.schedule()

    assert out.preempted_req_ids == ["new"]
    assert out.num_scheduled_tokens == {"old": 1}
    assert scheduler.kv.num_free_blocks == 1


def test_several_victims_are_taken_from_the_back_and_keep_their_order_in_waiting() -> None:
    scheduler = make_scheduler(3)
    for name, start in (("a", 1000), ("b", 2000), ("c", 3000)):
        scheduler.add_request(make_request(name, tokens(4, start)))
    step(scheduler)

    out = scheduler.schedule()

    # "a" needs a block: "c" goes; "b" then needs one too and, being last, preempts itself.
    assert out.preempted_req_ids == ["c", "b"]
    assert out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_preempted_request_is_resent_whole_and_recomputed() -> None:
    scheduler = make_scheduler(2)
    scheduler.add_request(make_request("old", tokens(4)))
    scheduler.add_request(make_request("new", tokens(2, 2000)))
    step(scheduler, token=5)
    out, _ = step(scheduler)
    assert out.preempted_req_ids == ["new"]
    scheduler.finish_requests(["old"], RequestStatus.FINISHED_ABORTED)

    out, outputs = step(scheduler, token=6)

    assert out.finished_req_ids == ["old"]
    (resent,) = out.scheduled_new_reqs
    assert resent.req_id == "new"
    assert resent.token_ids == [2000, 2001, 5]  # prompt plus the token made before preemption
    assert resent.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"new": 3}
    assert output_of(outputs, "new").new_token_ids == [6]
    assert output_of(outputs, "new").num_preemptions == 1
    assert scheduler.requests["new"].output_token_ids == [5, 6]


def test_preempted_request_recomputes_from_its_own_cached_prefix() -> None:
    scheduler = make_scheduler(3, enable_caching=True)
    scheduler.add_request(make_request("old", tokens(4)))
    scheduler.add_request(make_request("new", tokens(5, 2000)))  # one full block, cached
    step(scheduler, token=5)
    out, _ = step(scheduler)  # "old" needs a third block: "new" is preempted
    assert out.preempted_req_ids == ["new"]
    scheduler.finish_requests(["old"], RequestStatus.FINISHED_ABORTED)

    out = scheduler.schedule()

    (resent,) = out.scheduled_new_reqs
    assert resent.num_computed_tokens == BS  # its first block survived in the prefix cache
    assert out.num_scheduled_tokens == {"new": 2}
    assert scheduler.requests["new"].num_cached_tokens == 0  # recorded at first admission only


# ---- the worker-facing diff ----------------------------------------------------------------------


def test_new_request_is_sent_whole_once_then_only_as_a_diff() -> None:
    scheduler = make_scheduler(8)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    scheduler.add_request(Request("r", tokens(6), params, EOS, BS))

    out, _ = step(scheduler)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.token_ids, new.block_ids, new.num_computed_tokens) == (
        "r",
        tokens(6),
        [0, 1],
        0,
    )
    assert new.sampling_params == params
    assert out.scheduled_cached_reqs.req_ids == []

    diffs = []
    for _ in range(3):
        out, _ = step(scheduler)
        assert out.scheduled_new_reqs == []
        cached = out.scheduled_cached_reqs
        assert cached.req_ids == ["r"]
        diffs.append((cached.new_block_ids[0], cached.num_computed_tokens[0]))
    # Positions 6 and 7 fit in block 1; position 8 opens block 2.
    assert diffs == [([], 6), ([], 7), ([2], 8)]


# ---- stop conditions in update_from_output -------------------------------------------------------


def run_to_finish(scheduler: Scheduler, req_id: str, sampled: list[int]) -> EngineCoreOutput:
    """Step with the given tokens, one per step, until `req_id` finishes; return its last output."""
    for token in sampled:
        _, outputs = step(scheduler, token)
        last = output_of(outputs, req_id)
        if last.finish_reason is not None:
            return last
    raise AssertionError(f"{req_id} did not finish after {len(sampled)} tokens")


def test_eos_stops_the_request_and_frees_its_blocks() -> None:
    scheduler = make_scheduler(4)
    request = make_request("r", tokens(3))
    scheduler.add_request(request)

    last = run_to_finish(scheduler, "r", [5, EOS, 5])

    assert (last.new_token_ids, last.finish_reason, last.stop_reason) == ([EOS], "stop", None)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [5, EOS]
    assert scheduler.running == [] and "r" not in scheduler.requests
    assert scheduler.kv.num_free_blocks == 4
    idle = scheduler.schedule()  # nothing to run: no step, and the news waits for one
    assert (idle.total_num_scheduled_tokens, idle.finished_req_ids) == (0, [])
    scheduler.add_request(make_request("next", tokens(3)))
    assert scheduler.schedule().finished_req_ids == ["r"]
    assert scheduler.schedule().finished_req_ids == []  # reported once


def test_eos_is_ignored_with_ignore_eos() -> None:
    scheduler = make_scheduler(4)
    scheduler.add_request(make_request("r", tokens(3), ignore_eos=True, max_tokens=3))

    last = run_to_finish(scheduler, "r", [EOS] * 5)

    assert last.finish_reason == "length"
    assert scheduler.last_stats.step == 2  # ran all three steps


def test_stop_token_id_stops_and_is_reported_as_the_stop_reason() -> None:
    scheduler = make_scheduler(4)
    scheduler.add_request(make_request("r", tokens(3), stop_token_ids=[42, 43]))

    last = run_to_finish(scheduler, "r", [5, 43])

    assert (last.finish_reason, last.stop_reason) == ("stop", 43)


def test_max_tokens_stops_with_length() -> None:
    scheduler = make_scheduler(4)
    request = make_request("r", tokens(3), max_tokens=3)
    scheduler.add_request(request)

    last = run_to_finish(scheduler, "r", [5] * 10)

    assert last.finish_reason == "length"
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_output_tokens == 3


def test_max_model_len_stops_with_length() -> None:
    scheduler = make_scheduler(4, max_model_len=8)
    request = make_request("r", tokens(6))
    scheduler.add_request(request)

    last = run_to_finish(scheduler, "r", [5] * 10)

    assert last.finish_reason == "length"
    assert request.num_tokens == 8
    assert request.num_output_tokens == 2


def test_eos_and_stop_tokens_before_min_tokens_do_not_stop() -> None:
    scheduler = make_scheduler(4)
    request = make_request("r", tokens(3), min_tokens=3, stop_token_ids=[42])
    scheduler.add_request(request)

    last = run_to_finish(scheduler, "r", [EOS, 42, EOS])

    assert request.output_token_ids == [EOS, 42, EOS]
    assert last.finish_reason == "stop"


# ---- aborts --------------------------------------------------------------------------------------


def test_abort_of_a_running_request_frees_blocks_and_is_reported_next_step() -> None:
    scheduler = make_scheduler(4)
    request = make_request("r", tokens(6))
    scheduler.add_request(request)
    step(scheduler)
    assert scheduler.kv.num_free_blocks == 2

    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)

    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.finish_reason == "abort"
    assert scheduler.kv.num_free_blocks == 4
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == []  # no step runs for an empty batch...
    scheduler.add_request(make_request("next", tokens(2, 3000)))
    out = scheduler.schedule()
    assert out.finished_req_ids == ["r"]  # ...so the workers hear of it in the next one
    assert list(out.num_scheduled_tokens) == ["next"]


def test_abort_of_a_waiting_request_takes_it_off_the_queue() -> None:
    scheduler = make_scheduler(4, max_num_seqs=1)
    scheduler.add_request(make_request("running", tokens(2)))
    scheduler.add_request(make_request("waiting", tokens(2, 2000)))
    step(scheduler)

    scheduler.finish_requests(["waiting", "unknown"], RequestStatus.FINISHED_ABORTED)

    assert list(scheduler.waiting) == []
    assert scheduler.schedule().finished_req_ids == ["waiting"]


def test_tokens_sampled_for_a_request_aborted_mid_step_are_dropped() -> None:
    scheduler = make_scheduler(4)
    scheduler.add_request(make_request("r", tokens(2)))
    out = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, out, token=5)

    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)

    assert scheduler.update_from_output(out, runner_output) == []
    assert scheduler.kv.num_free_blocks == 4


def test_aborting_a_finished_request_changes_nothing() -> None:
    scheduler = make_scheduler(4)
    request = make_request("r", tokens(2), max_tokens=1)
    scheduler.add_request(request)
    step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH

    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)

    assert request.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.kv.num_free_blocks == 4


# ---- why the waiting queue's head was not admitted -------------------------------------------
def test_waiting_request_not_admitted_when_the_budget_is_used() -> None:
    s = make_scheduler(64, budget=8)
    s.add_request(make_request("a", tokens(8)))
    s.add_request(make_request("b", tokens(4, 2000)))
    s.schedule()
    stats = s.last_stats
    assert (stats.waiting_reason, stats.num_waiting, stats.kv_blocks_short) == ("budget", 1, 0)


def test_waiting_request_not_admitted_when_max_num_seqs_are_running() -> None:
    s = make_scheduler(64, max_num_seqs=1)
    s.add_request(make_request("a", tokens(4)))
    s.add_request(make_request("b", tokens(4, 2000)))
    s.add_request(make_request("c", tokens(4, 3000)))
    s.schedule()
    assert (s.last_stats.waiting_reason, s.last_stats.num_waiting) == ("max_num_seqs", 2)


def test_waiting_request_not_admitted_when_blocks_short_says_how_many() -> None:
    s = make_scheduler(4)  # 16 tokens of KV
    s.add_request(make_request("a", tokens(12)))  # 3 blocks
    s.add_request(make_request("b", tokens(12, 2000)))  # needs 3, 1 is free
    s.schedule()
    assert (s.last_stats.waiting_reason, s.last_stats.kv_blocks_short) == ("kv_blocks", 2)


def test_a_preempted_head_waits_to_be_recomputed() -> None:
    s = make_scheduler(3)  # 12 tokens of KV
    s.add_request(make_request("a", tokens(4), ignore_eos=True))
    s.add_request(make_request("b", tokens(4, 2000), ignore_eos=True))
    for _ in range(8):  # decoding grows both until one must be preempted
        out = s.schedule()
        s.update_from_output(out, fake_runner_output(s, out, 7))
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == ["b"]
    assert (s.last_stats.waiting_reason, s.last_stats.num_waiting) == ("preempted", 1)


def test_nothing_waiting_records_no_reason() -> None:
    s = make_scheduler(64)
    s.add_request(make_request("a", tokens(4)))
    s.schedule()
    assert s.last_stats.waiting_reason is None and s.last_stats.num_waiting == 0


def test_step_context_counts_each_request_kv_length_after_the_step() -> None:
    """A 10-token prompt chunked 6 + 4, then a decode beside a request whose first two blocks
    are prefix hits: each step's context is the sum of its requests' KV lengths once it ran."""
    s = make_scheduler(16, budget=6, enable_caching=True)
    s.add_request(make_request("a", tokens(10), ignore_eos=True))
    step(s)
    assert s.last_stats.num_context_tokens == 6
    step(s)
    assert s.last_stats.num_context_tokens == 10
    s.add_request(make_request("b", [*tokens(8), 5000], ignore_eos=True))  # 8 hit, 1 to run
    step(s)
    assert s.last_stats.prefix_hit_tokens == 8
    assert s.last_stats.num_context_tokens == 11 + 9
