"""The engine-facing helpers: no-ops when tracing is off, sampling by step, context in a carrier."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from stepscope.engine.core.scheduler import StepStats
from stepscope.engine.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerOutput,
)
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import crossing, setup
from stepscope.traces import crossing_spans as cs
from stepscope.traces import names as n
from stepscope.traces import spans as sp
from stepscope.traces.crossing import traced_receive, traced_send
from stepscope.traces.setup import TraceSampling


def _one_step(step: int) -> None:
    with sp.step_span(StepStats(step=step), ["a"], [1]):
        with sp.child_span(n.SCHEDULE):
            pass
        crossing, carrier = cs.send_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 10, 1)
        with crossing:
            pass
        with cs.receive_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 10, 1, carrier):
            pass
        with sp.worker_step_span(step, 0, carrier), sp.child_span(n.FORWARD):
            pass


def test_helpers_are_noops_when_tracing_is_not_initialised():
    assert not setup.is_enabled()
    # What the last provider of this process dropped (an earlier test's) stays as it was.
    dropped_before = setup.dropped_spans()
    assert sp.step_span(StepStats(step=0)) is sp.NOOP
    assert sp.child_span(n.SCHEDULE) is sp.NOOP
    assert sp.worker_step_span(0, 0) is sp.NOOP
    assert cs.send_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 1, 1) == (sp.NOOP, {})
    assert cs.receive_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 1, 1, {}) is sp.NOOP
    request = sp.request_span("r", model="m")
    assert request is sp.NOOP
    with request as r, r.current():
        r.observe(object())
        r.add_events({"queued": 1.0})
        r.finish(output_tokens=1)
        r.set_nbytes(3)
        assert r.carrier == {}
    assert sp.inject_context() == {} and sp.request_link({"traceparent": "x"}) is None
    assert setup.get_tracer() is None and setup.dropped_spans() == dropped_before


@pytest.mark.parametrize(
    ("spec", "recorded"),
    [("all", [0, 1, 2, 3, 4, 5]), ("every:2", [0, 2, 4]), ("every:3", [0, 3]), ("off", [])],
)
def test_trace_steps_records_sampled_steps_and_all_their_spans(spec, recorded):
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[memory], trace_steps=spec)
    for step in range(6):
        _one_step(step)
    with sp.request_span("r", model="m"):
        pass
    setup.flush_tracing()
    spans = {}
    for s in memory.get_finished_spans():
        spans.setdefault(s.name, []).append(s)
    steps = sorted(s.attributes[n.STEP] for s in spans.get(n.ENGINE_STEP, []))
    assert steps == recorded
    for name in (n.SCHEDULE, n.SEND, n.RECEIVE, n.WORKER_STEP, n.FORWARD):
        assert len(spans.get(name, [])) == len(recorded), name
    assert len(spans[n.REQUEST]) == 1  # request spans are recorded whatever --trace-steps says


@pytest.mark.parametrize("bad", ["every:0", "every:x", "some", "every:-1"])
def test_trace_steps_rejects_bad_specs_with_a_usable_message(bad):
    with pytest.raises(ValueError, match="--trace-steps must be"):
        TraceSampling(bad)


def test_init_tracing_needs_a_destination():
    with pytest.raises(ValueError, match="collector_endpoint, otlp_endpoint or exporters"):
        setup.init_tracing(n.SERVICE_API)


def test_receive_follows_the_sender_decision_in_the_carrier():
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_WORKER, exporters=[memory], trace_steps="every:2")
    # A sender that did not record its step sends no context: the receiver records nothing...
    assert cs.receive_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 1, 1, {}) is sp.NOOP
    assert sp.worker_step_span(1, 0, {}) is sp.NOOP
    # ...and follows a sampled context whatever its own step count says.
    crossing, carrier = cs.send_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 1, 1, step=0)
    with crossing:
        pass
    with cs.receive_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 1, 1, carrier, step=1):
        pass
    setup.flush_tracing()
    send, receive = memory.get_finished_spans()
    assert receive.parent.span_id == send.context.span_id
    assert receive.context.trace_id == send.context.trace_id


def test_request_span_parents_on_incoming_traceparent_and_records_output():
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_API, exporters=[memory], trace_steps="off")
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    # Sampled flag 00: the client does not record, but stepscope always records requests.
    headers = {"traceparent": f"00-{trace_id}-{span_id}-00"}

    class Output:  # an EngineCoreOutput's shape
        def __init__(self, tokens, events=None, finish=None):
            self.new_token_ids = tokens
            self.events = events or {}
            self.finish_reason = finish
            self.num_cached_tokens = 16
            self.num_preemptions = 1

    with sp.request_span("r9", model="m", operation="text_completion", headers=headers) as req:
        crossing, carrier = cs.send_span(n.API_TO_ENGINE_CORE, "EngineCoreRequest", 5, 1)
        req.observe(Output([1, 2], {"queued": 100.0, "scheduled": 100.5, "first_token": 101.0}))
        req.observe(Output([3], {"preempted": 101.5, "finished": 102.0}, finish="stop"))
    assert crossing is sp.NOOP  # --trace-steps off: no crossing spans...
    link = sp.request_link(carrier)  # ...but the engine core can still link to the request
    setup.flush_tracing()
    (span,) = memory.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == trace_id
    assert f"{span.parent.span_id:016x}" == span_id
    assert link.span_id == span.context.span_id
    assert span.attributes[n.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert span.attributes[n.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert span.attributes[n.GEN_AI_OPERATION_NAME] == "text_completion"
    assert span.attributes[n.NUM_CACHED_TOKENS] == 16
    assert span.attributes[n.NUM_PREEMPTIONS] == 1
    assert [(e.name, e.timestamp) for e in span.events] == [
        ("queued", 100_000_000_000),
        ("scheduled", 100_500_000_000),
        ("first_token", 101_000_000_000),
        ("preempted", 101_500_000_000),
        ("finished", 102_000_000_000),
    ]


def test_exception_inside_a_span_marks_it_as_error():
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[memory])
    with pytest.raises(RuntimeError), sp.step_span(step=0):
        raise RuntimeError("worker died")
    setup.flush_tracing()
    (span,) = memory.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert span.events[0].name == "exception"


def test_step_span_rejects_unparallel_request_arrays():
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[InMemorySpanExporter()])
    with pytest.raises(ValueError, match="parallel"):
        sp.step_span(StepStats(step=0), ["a", "b"], [1])


def test_forked_child_does_not_inherit_the_provider():
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[InMemorySpanExporter()])
    pid = os.fork()
    if pid == 0:  # the child: tracing must be off until it calls init_tracing itself
        os._exit(0 if not setup.is_enabled() and sp.step_span(step=0) is sp.NOOP else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert setup.is_enabled()


class _BlockedExporter(SpanExporter):
    """Holds every export until released, so the processor's queue fills up."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.release.wait(30)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


def test_full_queue_drops_are_counted_and_logged(caplog):
    exporter = _BlockedExporter()
    setup.init_tracing(
        n.SERVICE_ENGINE_CORE, exporters=[exporter], max_queue_size=16, schedule_delay_ms=10
    )
    with caplog.at_level(logging.WARNING, logger="stepscope.traces.setup"):
        for step in range(200):
            with sp.step_span(step=step):
                pass
        exporter.release.set()
        dropped = setup.shutdown_tracing()
    assert dropped > 0
    assert exporter.exported + dropped == 200  # every span is either delivered or counted
    assert setup.dropped_spans() == dropped
    assert any("dropped" in record.getMessage() for record in caplog.records)


def test_unreachable_collector_counts_every_span_as_dropped(caplog, tmp_path: Path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    setup.init_tracing(
        n.SERVICE_API, collector_endpoint=f"http://127.0.0.1:{port}", export_timeout_s=0.5
    )
    with caplog.at_level(logging.WARNING, logger="stepscope.traces.setup"):
        for i in range(50):
            with sp.request_span(f"r{i}", model="m"):
                pass
        setup.flush_tracing()
        assert setup.dropped_spans() == 50
        assert setup.shutdown_tracing() == 50
    assert any("50 spans lost" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "module, unwanted",
    [
        # The helpers the engine calls do not load the database stack into every process ...
        ("stepscope.traces.spans", "m in ('duckdb', 'pandas', 'pyarrow')"),
        # ... and the boundary helper does not load the engine it serves.
        ("stepscope.traces.crossing", "m.startswith('stepscope.engine')"),
    ],
)
def test_engine_facing_helpers_import_only_what_they_need(module, unwanted):
    script = f"import sys, {module}; print(sorted(m for m in sys.modules if {unwanted}))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _scheduler_output(step: int) -> SchedulerOutput:
    return SchedulerOutput(
        step=step,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(req_ids=["a", "b"]),
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
        finished_req_ids=[],
        preempted_req_ids=[],
    )


def test_traced_send_then_receive_records_producer_and_consumer_joined_by_context():
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[memory])
    encoder = msgspec.msgpack.Encoder()
    sent: list[bytes] = []
    with sp.step_span(step=3):
        data = traced_send(
            crossing.ENGINE_CORE_TO_WORKER, encoder.encode, _scheduler_output(3), send=sent.append
        )
    received = traced_receive(
        crossing.ENGINE_CORE_TO_WORKER, msgspec.msgpack.Decoder(SchedulerOutput).decode, data
    )
    setup.flush_tracing()
    assert sent == [data]  # handed on inside the span
    assert received.num_scheduled_tokens == {"a": 1, "b": 1}
    spans = {s.name: s for s in memory.get_finished_spans()}
    send, receive = spans[n.SEND], spans[n.RECEIVE]
    assert send.kind is SpanKind.PRODUCER and receive.kind is SpanKind.CONSUMER
    assert send.parent.span_id == spans[n.ENGINE_STEP].context.span_id
    assert receive.parent.span_id == send.context.span_id
    assert receive.context.trace_id == send.context.trace_id
    for span in (send, receive):
        assert span.attributes[n.BOUNDARY] == n.ENGINE_CORE_TO_WORKER
        assert span.attributes[n.MESSAGE_TYPE] == "SchedulerOutput"
        assert span.attributes[n.MESSAGE_BODY_SIZE] == len(data)
        assert span.attributes[n.NUM_REQUESTS] == 2
        assert span.attributes[n.MESSAGING_SYSTEM] == n.MESSAGING_SYSTEM_ZMQ
    assert receive.start_time >= send.start_time


def test_traced_crossing_names_the_requests_of_engine_core_outputs():
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[memory])
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r1", [7]), EngineCoreOutput("r2", [8], finish_reason="stop")]
    )
    data = traced_send(crossing.ENGINE_CORE_TO_API, msgspec.msgpack.encode, outputs)
    decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
    traced_receive(crossing.ENGINE_CORE_TO_API, decoder.decode, memoryview(data))
    setup.flush_tracing()
    send, receive = memory.get_finished_spans()
    assert receive.parent.span_id == send.context.span_id
    for span in (send, receive):
        assert span.attributes[n.BOUNDARY] == n.ENGINE_CORE_TO_API
        assert span.attributes[n.MESSAGE_TYPE] == "EngineCoreOutputs"
        assert span.attributes[n.REQUEST_IDS] == ("r1", "r2")
        assert span.attributes[n.NUM_REQUESTS] == 2
        assert span.attributes[n.MESSAGE_BODY_SIZE] == len(data)


def test_traced_crossing_of_an_unsampled_step_records_nothing_on_either_end():
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[memory], trace_steps="every:2")
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    data = traced_send(crossing.ENGINE_CORE_TO_WORKER, msgspec.msgpack.encode, _scheduler_output(1))
    assert traced_receive(crossing.ENGINE_CORE_TO_WORKER, decoder.decode, data).step == 1
    setup.flush_tracing()
    assert memory.get_finished_spans() == ()


def test_traced_crossing_without_tracing_only_encodes_and_decodes():
    assert not setup.is_enabled()
    request = EngineCoreRequest("r", [1, 2], SamplingParams(), None, 0.0)
    sent: list[bytes] = []
    data = traced_send(
        crossing.API_TO_ENGINE_CORE, msgspec.msgpack.encode, request, send=sent.append
    )
    assert sent == [data] and data == msgspec.msgpack.encode(request)
    decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    assert traced_receive(crossing.API_TO_ENGINE_CORE, decoder.decode, data) == request
