"""The output processor (stages 9-10) and the n > 1 fan-out, fed hand-made engine-core outputs:
stop strings end and abort requests, metrics are filled, children fan out and merge back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from stepscope.engine.frontend.output_processor import OutputProcessor
from stepscope.engine.frontend.parallel_sampling import child_requests, interleave, merge_outputs
from stepscope.engine.messages import EngineCoreOutput, EngineCoreRequest, Logprob
from stepscope.engine.models.loader import load_tokenizer, resolve_model
from stepscope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names
from stepscope.traces.names import RequestEvent

TEXT = "Hello world. Stop here. More text"
ARRIVAL = 1000.0


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(resolve_model("tiny-llama"))


@pytest.fixture(scope="module")
def ids(tok: Any) -> list[int]:
    return tok.encode(TEXT, add_special_tokens=False)


def add(
    proc: OutputProcessor, params: SamplingParams, *, stream: bool, request_id: str = "r"
) -> None:
    request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=params,
        eos_token_id=None,
        arrival_time=ARRIVAL,
    )
    proc.add_request(request, operation=names.OPERATION_TEXT_COMPLETION, stream=stream)


def step(token_id: int, request_id: str = "r", **fields: Any) -> EngineCoreOutput:
    lp = Logprob(token_ids=[token_id], logprobs=[-float(token_id)])
    return EngineCoreOutput(request_id, [token_id], new_logprobs=[lp], **fields)


def test_stop_string_ends_request_and_asks_for_its_abort(tok: Any, ids: list[int]) -> None:
    proc = OutputProcessor(tok, "tiny-llama")
    add(proc, SamplingParams(stop=["Stop"], max_tokens=None), stream=True)
    deltas, aborts, last = [], [], None
    for token_id in ids:
        processed = proc.process_outputs([step(token_id)])
        aborts += processed.reqs_to_abort
        for out in processed.request_outputs:
            deltas.append(out.outputs[0].text)
            last = out
    assert aborts == ["r"]
    assert last is not None and last.finished
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", "Stop")
    assert "".join(deltas) == "Hello world. "
    assert not proc.has_unfinished_requests()  # later outputs of the request are ignored


def test_stop_string_in_the_engine_cores_last_step_needs_no_abort(tok: Any, ids: list[int]) -> None:
    proc = OutputProcessor(tok, "tiny-llama")
    add(proc, SamplingParams(stop=["Stop"]), stream=True)
    stop_at = ids.index(tok.encode(" Stop", add_special_tokens=False)[0])
    proc.process_outputs([step(t) for t in ids[:stop_at]])
    last = proc.process_outputs([step(ids[stop_at], finish_reason="length")])
    assert last.reqs_to_abort == []
    assert last.request_outputs[0].outputs[0].finish_reason == "stop"


def test_final_output_holds_whole_text_logprobs_and_metrics(tok: Any, ids: list[int]) -> None:
    proc = OutputProcessor(tok, "tiny-llama", server=False)
    add(proc, SamplingParams(max_tokens=len(ids), logprobs=0), stream=False)
    events = {
        RequestEvent.QUEUED: ARRIVAL,
        RequestEvent.SCHEDULED: ARRIVAL + 1,
        RequestEvent.FIRST_TOKEN: ARRIVAL + 2,
    }
    first = proc.process_outputs([step(ids[0], events=events, num_cached_tokens=16)])
    assert first.request_outputs == []  # nothing is delivered before the end
    for token_id in ids[1:-1]:
        assert proc.process_outputs([step(token_id, num_cached_tokens=16)]).request_outputs == []
    end = step(
        ids[-1],
        finish_reason="length",
        events={RequestEvent.FINISHED: ARRIVAL + 3},
        num_cached_tokens=16,
        num_preemptions=1,
    )
    (out,) = proc.process_outputs([end]).request_outputs
    completion = out.outputs[0]
    assert out.finished and completion.finish_reason == "length"
    assert completion.text == TEXT
    assert completion.token_ids == ids
    assert completion.logprobs == [{t: -float(t)} for t in ids]
    assert out.metrics == RequestMetrics(
        arrival_time=ARRIVAL,
        queued_time=ARRIVAL,
        first_scheduled_time=ARRIVAL + 1,
        first_token_time=ARRIVAL + 2,
        finished_time=ARRIVAL + 3,
        num_preemptions=1,
        num_cached_tokens=16,
    )
    assert out.metrics.queue_time == 1 and out.metrics.ttft == 2
    assert out.num_cached_tokens == 16


def test_final_output_drops_tokens_and_logprobs_after_stop_string(tok: Any, ids: list[int]) -> None:
    proc = OutputProcessor(tok, "tiny-llama", server=False)
    add(proc, SamplingParams(stop=["Stop"], logprobs=0), stream=False)
    processed = proc.process_outputs([EngineCoreOutput("r", ids, new_logprobs=[
        Logprob(token_ids=[t], logprobs=[-float(t)]) for t in ids
    ])])  # fmt: skip
    assert processed.reqs_to_abort == ["r"]
    (out,) = processed.request_outputs
    completion = out.outputs[0]
    assert completion.text == "Hello world. "
    assert len(completion.logprobs) == len(completion.token_ids) < len(ids)


def test_aborted_request_is_forgotten(tok: Any, ids: list[int]) -> None:
    proc = OutputProcessor(tok, "tiny-llama")
    add(proc, SamplingParams(), stream=True)
    proc.abort_requests(["r", "unknown"])
    assert not proc.has_unfinished_requests()
    assert proc.process_outputs([step(ids[0])]).request_outputs == []


def test_request_id_in_flight_is_refused(tok: Any) -> None:
    proc = OutputProcessor(tok, "tiny-llama")
    add(proc, SamplingParams(), stream=True)
    with pytest.raises(ValueError, match="already in flight"):
        add(proc, SamplingParams(), stream=True)


def test_n_1_is_its_own_child() -> None:
    params = SamplingParams(seed=7)
    assert child_requests("cmpl-x", params) == [("cmpl-x", params)]


def test_n_3_fans_out_to_children_with_derived_ids_and_seeds() -> None:
    children = child_requests("cmpl-x", SamplingParams(n=3, seed=7, temperature=0.5))
    assert [rid for rid, _ in children] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    assert [p.seed for _, p in children] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.5 for _, p in children)
    unseeded = child_requests("r", SamplingParams(n=2))
    assert [p.seed for _, p in unseeded] == [None, None]


def test_merge_puts_each_child_at_its_choice_index() -> None:
    def child(k: int) -> RequestOutput:
        return RequestOutput(
            request_id=f"r-{k}",
            prompt="p",
            prompt_token_ids=[1, 2],
            outputs=[CompletionOutput(index=0, text=f"t{k}", token_ids=[k])],
            finished=True,
            metrics=RequestMetrics(arrival_time=float(k), num_cached_tokens=k + 4),
            prompt_logprobs=[None, {2: -1.0}] if k == 1 else None,
        )

    merged = merge_outputs("r", [child(0), child(1)])
    assert merged.request_id == "r" and merged.finished and merged.prompt == "p"
    assert [(c.index, c.text) for c in merged.outputs] == [(0, "t0"), (1, "t1")]
    assert merged.metrics.arrival_time == 0.0 and merged.num_cached_tokens == 4
    assert [m.arrival_time for m in merged.children_metrics] == [0.0, 1.0]
    assert merged.prompt_logprobs == [None, {2: -1.0}]


def test_interleave_yields_every_childs_items_with_its_key() -> None:
    async def items(*xs: str) -> AsyncIterator[str]:
        for x in xs:
            await asyncio.sleep(0)
            yield x

    async def collect() -> list[tuple[int, str]]:
        return [item async for item in interleave({0: items("a", "b"), 1: items("c")})]

    got = asyncio.run(collect())
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "c")]
    assert [x for k, x in got if k == 0] == ["a", "b"]


def test_interleave_raises_a_childs_error_and_cancels_the_others() -> None:
    cancelled = asyncio.Event()

    async def forever() -> AsyncIterator[str]:
        try:
            yield "x"
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def broken() -> AsyncIterator[str]:
        await asyncio.sleep(0.01)
        raise RuntimeError("child failed")
        yield ""  # an async generator

    async def run() -> None:
        merged = interleave({0: forever(), 1: broken()})
        try:
            with pytest.raises(RuntimeError, match="child failed"):
                async for _ in merged:
                    pass
        finally:
            await merged.aclose()
        assert cancelled.is_set()

    asyncio.run(run())
