"""A request that waits too long is named once (engine/core/long_wait.py): by the real scheduler's
reason, in a warning line and a notice that the API side turns into a `long_wait` span event
(and never into an output for the caller)."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stepscope.engine.config import EngineConfig
from stepscope.engine.core.long_wait import MAX_LINES, LongWaitWatch
from stepscope.engine.frontend.output_processor import OutputProcessor
from stepscope.engine.messages import EngineCoreOutput, EngineCoreRequest, LongWait
from stepscope.engine.models.loader import load_tokenizer, resolve_model
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names, setup
from stepscope.traces.names import RequestEvent
from tests.engine.core.test_scheduler import make_request, make_scheduler, step, tokens

NOW = 1000.0


def queued_at(req_id: str, queued: float, start: int, n: int = 4):
    request = make_request(req_id, tokens(n, start), max_tokens=50)
    request.events.queued = queued
    return request


def test_waiting_past_the_threshold_is_named_once_with_the_heads_reason(caplog) -> None:
    s = make_scheduler(64, max_num_seqs=1)
    for i, queued in enumerate((NOW - 60, NOW - 40, NOW - 5)):
        s.add_request(queued_at(f"r{i}", queued, 1000 * (i + 1)))
    watch = LongWaitWatch(30.0)
    step(s)  # r0 runs; r1 and r2 wait behind the full batch
    with caplog.at_level(logging.WARNING):
        notices = watch.check(s, NOW)
    (notice,) = notices  # r1 waited 40 s; r2 only 5 s; r0 runs
    assert notice.request_id == "r1" and notice.new_token_ids == []
    assert notice.events == {RequestEvent.LONG_WAIT: NOW}
    assert notice.long_wait == LongWait(40.0, "max_num_seqs", 0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "request r1 has waited 40.00 s" in line and "max_num_seqs=1" in line
    # The same schedule is not looked at twice; the next names r1 no more, and r2 once it is due.
    assert watch.check(s, NOW + 30) == []
    step(s)
    assert [n.request_id for n in watch.check(s, NOW + 30)] == ["r2"]
    step(s)
    assert watch.check(s, NOW + 100) == []


@pytest.mark.parametrize("log", [True, False])
def test_many_at_once_name_the_first_few_and_count_the_rest(caplog, log) -> None:
    s = make_scheduler(64, max_num_seqs=1)
    for i in range(8):
        s.add_request(queued_at(f"r{i}", NOW - 60, 1000 * (i + 1)))
    step(s)  # r0 runs; seven wait
    with caplog.at_level(logging.WARNING):
        notices = LongWaitWatch(30.0, log=log).check(s, NOW)
    assert [n.request_id for n in notices] == [f"r{i}" for i in range(1, 8)]  # every span
    lines = [r.getMessage() for r in caplog.records]
    if not log:  # an offline engine: span events only
        assert lines == []
        return
    assert len(lines) == MAX_LINES + 1
    assert [line.split()[2] for line in lines[:MAX_LINES]] == ["r1", "r2", "r3"]
    assert f"and {7 - MAX_LINES} more requests have waited over 30 s" in lines[-1]


def test_no_threshold_or_nobody_waiting_names_nobody() -> None:
    s = make_scheduler(64)
    s.add_request(queued_at("r0", NOW - 60, 1000))
    step(s)  # admitted: nobody waits
    assert LongWaitWatch(30.0).check(s, NOW) == []
    s = make_scheduler(64, max_num_seqs=1)
    for i in range(2):
        s.add_request(queued_at(f"r{i}", NOW - 60, 1000 * (i + 1)))
    step(s)
    assert LongWaitWatch(None).check(s, NOW) == []


def test_kv_blocks_reason_says_how_many_blocks_the_head_lacks() -> None:
    s = make_scheduler(3, budget=64)  # 3 blocks of 4 tokens
    s.add_request(queued_at("big", NOW - 60, 1000, n=12))  # takes all 3
    s.add_request(queued_at("r1", NOW - 60, 2000))
    s.schedule()
    (notice,) = LongWaitWatch(1.0).check(s, NOW)
    assert (notice.request_id, notice.long_wait) == ("r1", LongWait(60.0, "kv_blocks", 1))


def test_a_notice_becomes_a_span_event_and_no_output() -> None:
    memory = InMemorySpanExporter()
    setup.init_tracing(names.SERVICE_API, exporters=[memory])
    try:
        proc = OutputProcessor(load_tokenizer(resolve_model("tiny-llama")), "tiny-llama")
        request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), None, NOW)
        state = proc.add_request(request, operation=names.OPERATION_CHAT, stream=True)
        notice = EngineCoreOutput(
            "r", [], events={RequestEvent.LONG_WAIT: NOW + 31},
            long_wait=LongWait(31.0, "kv_blocks", 2),
        )  # fmt: skip
        assert proc.process_outputs([notice]).request_outputs == []
        assert state.metrics.num_cached_tokens == 0 and state.finish_reason is None
        last = EngineCoreOutput("r", [42], finish_reason="length")
        (out,) = proc.process_outputs([last]).request_outputs
        assert out.outputs[0].token_ids == [42] and out.finished
        state.span.end()
        setup.flush_tracing()
    finally:
        setup.shutdown_tracing()
    (span,) = memory.get_finished_spans()
    (event,) = [e for e in span.events if e.name == RequestEvent.LONG_WAIT]
    assert event.timestamp == int((NOW + 31) * 1e9)
    assert dict(event.attributes) == {
        names.WAITING_REASON: "kv_blocks", names.WAITED_S: 31.0, names.KV_BLOCKS_SHORT: 2,
    }  # fmt: skip


def test_long_wait_warning_s_must_be_positive_or_none() -> None:
    assert EngineConfig.create().observability_config.long_wait_warning_s == 30.0
    assert (
        EngineConfig.create(long_wait_warning_s=None).observability_config.long_wait_warning_s
        is None
    )
    with pytest.raises(ValueError, match="long_wait_warning_s must be positive"):
        EngineConfig.create(long_wait_warning_s=0)
