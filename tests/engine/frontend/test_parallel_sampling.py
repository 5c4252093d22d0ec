"""`ParentRequest`, fed hand-made outputs: n > 1 fans out into children with derived ids and
seeds, and their outputs merge back, each completion at its choice index."""

from __future__ import annotations

import pytest

from stepscope.engine.frontend.parallel_sampling import ParentRequest
from stepscope.engine.messages import EngineCoreRequest
from stepscope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from stepscope.engine.sampling_params import FieldError, SamplingParams


def request(params: SamplingParams, request_id: str = "r") -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2],
        sampling_params=params,
        eos_token_id=None,
        arrival_time=0.0,
    )


def child(k: int, *, finished: bool = True, prompt_logprobs: list | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=f"r-{k}",
        prompt="p",
        prompt_token_ids=[1, 2],
        outputs=[
            CompletionOutput(
                index=0, text=f"t{k}", token_ids=[k], finish_reason="length" if finished else None
            )
        ],
        finished=finished,
        metrics=RequestMetrics(arrival_time=float(k), num_cached_tokens=k + 4),
        num_cached_tokens=k + 4,
        prompt_logprobs=prompt_logprobs,
    )


def test_n_1_is_its_own_only_child() -> None:
    req = request(SamplingParams(seed=7), "cmpl-x")
    assert ParentRequest(req).children == [req]


def test_n_3_fans_out_to_children_with_derived_ids_and_seeds() -> None:
    parent = ParentRequest(request(SamplingParams(n=3, seed=7, temperature=0.5), "cmpl-x"))
    assert parent.child_ids == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    params = [c.sampling_params for c in parent.children]
    assert [p.seed for p in params] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.5 for p in params)
    unseeded = ParentRequest(request(SamplingParams(n=2)))
    assert [c.sampling_params.seed for c in unseeded.children] == [None, None]


def test_a_seed_whose_children_overflow_is_refused_as_the_seed_field() -> None:
    with pytest.raises(FieldError, match="64-bit") as info:
        ParentRequest(request(SamplingParams(n=2, seed=2**63 - 1)))
    assert info.value.param == "seed"


def test_final_outputs_merge_with_each_child_at_its_choice_index() -> None:
    parent = ParentRequest(request(SamplingParams(n=2)))
    merged = parent.merge([child(1, prompt_logprobs=[None, {2: -1.0}]), child(0)])
    assert merged.request_id == "r" and merged.finished and merged.prompt == "p"
    assert [(c.index, c.text) for c in merged.outputs] == [(0, "t0"), (1, "t1")]
    assert merged.metrics.arrival_time == 0.0 and merged.num_cached_tokens == 4
    assert [m.arrival_time for m in merged.children_metrics] == [0.0, 1.0]
    assert merged.prompt_logprobs == [None, {2: -1.0}]


def test_streamed_increments_finish_only_once_every_child_has() -> None:
    parent = ParentRequest(request(SamplingParams(n=3)))
    first = parent.merge([child(2, finished=False), child(0)])
    assert [c.index for c in first.outputs] == [0, 2] and not first.finished
    assert [m.arrival_time for m in first.children_metrics] == [0.0, 2.0]  # as outputs
    assert not parent.merge([child(1)]).finished
    last = parent.merge([child(2)])
    assert [c.index for c in last.outputs] == [2] and last.finished
