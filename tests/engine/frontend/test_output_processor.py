"""The output processor (stages 9-10), fed hand-made engine-core outputs: stop strings end and
abort requests, metrics are filled."""

from __future__ import annotations

from typing import Any

import pytest

from stepscope.engine.frontend.output_processor import OutputProcessor
from stepscope.engine.messages import EngineCoreOutput, EngineCoreRequest, Logprob
from stepscope.engine.outputs import RequestMetrics
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names
from stepscope.traces.names import RequestEvent

TEXT = "Hello world. Stop here. More text"
ARRIVAL = 1000.0


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
