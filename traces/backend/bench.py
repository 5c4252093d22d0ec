"""How many spans per second the collector gets into DuckDB (target: >= 50,000 spans/s).

    python -m stepscope.traces.backend.bench [--spans 200000] [--senders 3]

The spans are what the engine records: per step an engine_step (all attributes, links to its
requests) with schedule/execute/update, a worker_step with prepare_inputs/forward/sample, four
crossing spans, and now and then a request span with its events. They are recorded once through
the real helpers and encoded as OTLP requests of 2,048 spans (the SDK's export batch), then
POSTed by `senders` threads, like that many processes, to a collector process. The clock runs from
the first POST until the collector reports every span inserted. Printed beside it, measured in
the same run: the same payloads parsed and inserted in this process with no HTTP (the ceiling).
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stepscope.traces import crossing_spans, setup, spans
from stepscope.traces import names as n
from stepscope.traces.backend.client import CollectorClient
from stepscope.traces.backend.collector_process import (
    start_collector_process,
    stop_collector_process,
)
from stepscope.traces.backend.store import TraceStore

BATCH_SPANS = 2048


class _Stats:
    """A StepStats stand-in (the traces package does not import the engine)."""

    def __init__(self, step: int, request_ids: list[str]) -> None:
        self.step = step
        self.num_running = len(request_ids)
        self.num_waiting = 3
        self.num_decode_tokens = len(request_ids) - 1
        self.num_prefill_tokens = 480
        self.token_budget = 2048
        self.kv_free_before = 900
        self.kv_free_after = 870
        self.kv_total_blocks = 1024
        self.prefix_hit_tokens = 32
        self.preempted: tuple[str, ...] = ()
        self.finished = (request_ids[0],) if step % 16 == 0 else ()


def sample_spans(num_spans: int) -> list:
    """Record about `num_spans` engine-like spans through the helpers, in memory."""
    exporter = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[exporter])
    step = 0
    links: dict = {}
    while len(exporter.get_finished_spans()) < num_spans:
        request_ids = [f"req-{step // 16}-{i}" for i in range(8)]
        if step % 16 == 0:
            with spans.request_span(request_ids[0], model="tiny-llama", max_tokens=64) as req:
                req.add_events(
                    {n.RequestEvent.QUEUED: time.time(), n.RequestEvent.SCHEDULED: time.time()}
                )
                links[request_ids[0]] = spans.request_link(req.carrier)
                req.finish(input_tokens=500, output_tokens=16, finish_reasons=["length"])
        with spans.step_span(step=step) as span:
            with spans.child_span(n.SCHEDULE):
                pass
            span.record(_Stats(step, request_ids), {r: 1 for r in request_ids}, links=links)
            with spans.child_span(n.EXECUTE):
                crossing, carrier = crossing_spans.send_span(
                    n.ENGINE_CORE_TO_WORKER, "SchedulerOutput"
                )
                with crossing:
                    crossing.set_nbytes(1200)
                with crossing_spans.receive_span(
                    n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 1200, 8, carrier
                ):
                    pass
                with spans.worker_step_span(step, 0, carrier):
                    for phase in (n.PREPARE_INPUTS, n.FORWARD, n.SAMPLE):
                        with spans.child_span(phase):
                            pass
                    back, back_carrier = crossing_spans.send_span(
                        n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", 300, 8
                    )
                    with back:
                        pass
                with crossing_spans.receive_span(
                    n.WORKER_TO_ENGINE_CORE, "ModelRunnerOutput", 300, 8, back_carrier
                ):
                    pass
            with spans.child_span(n.UPDATE):
                pass
        step += 1
    setup.shutdown_tracing()
    return list(exporter.get_finished_spans())[:num_spans]


def encode_payloads(recorded: list) -> list[tuple[bytes, int]]:
    """OTLP ExportTraceServiceRequest bytes, BATCH_SPANS spans each, with their span counts."""
    return [
        (
            encode_spans(recorded[i : i + BATCH_SPANS]).SerializeToString(),
            len(recorded[i : i + BATCH_SPANS]),
        )
        for i in range(0, len(recorded), BATCH_SPANS)
    ]


def _post_all(url: str, payloads: list[tuple[bytes, int]], errors: list[str]) -> None:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    for body, _ in payloads:
        while True:
            connection.request(
                "POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"}
            )
            response = connection.getresponse()
            response.read()
            if response.status == 200:
                break
            if response.status != 503:
                errors.append(f"HTTP {response.status}")
                return
            time.sleep(0.2)  # the collector asked us to back off
    connection.close()


def bench_collector(num_spans: int = 200_000, senders: int = 3) -> dict[str, float]:
    """Measure spans/s through a collector process into DuckDB; prints and returns the numbers."""
    template = encode_payloads(sample_spans(min(num_spans, 20 * BATCH_SPANS)))
    payloads: list[tuple[bytes, int]] = []
    while sum(count for _, count in payloads) < num_spans:
        payloads.extend(template)
    total = sum(count for _, count in payloads)
    payload_bytes = sum(len(body) for body, _ in payloads)

    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_collector_process(str(Path(tmp) / "bench.duckdb"))
        client = CollectorClient(url, timeout_s=600)
        errors: list[str] = []
        threads = [
            threading.Thread(target=_post_all, args=(url, payloads[i::senders], errors))
            for i in range(senders)
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        sent = time.perf_counter()
        stats = client.flush(timeout_s=600)
        elapsed = time.perf_counter() - start
        stop_collector_process(process)
        if errors or stats["inserted"] != total:
            raise RuntimeError(f"collector bench lost spans: {stats}, errors {errors[:3]}")

        # The ceiling: the same bytes parsed and inserted in this process, no HTTP, one thread.
        store = TraceStore(Path(tmp) / "direct.duckdb")
        direct_start = time.perf_counter()
        for body, _ in payloads:
            store.insert_otlp(body)
        direct = time.perf_counter() - direct_start
        store.close()

    result = {
        "spans": total,
        "collector_spans_per_s": total / elapsed,
        "collector_seconds": elapsed,
        "send_seconds": sent - start,
        "direct_spans_per_s": total / direct,
        "bytes_per_span": payload_bytes / total,
    }
    print(
        f"machine: {platform.machine()} {cpu_name()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}"
    )
    print(
        f"collector (HTTP, {senders} senders -> 1 writer -> DuckDB): {total:,} spans in "
        f"{elapsed:.2f} s = {result['collector_spans_per_s']:,.0f} spans/s "
        f"(all sent after {result['send_seconds']:.2f} s; {result['bytes_per_span']:.0f} B/span)"
    )
    ratio = result["collector_spans_per_s"] / result["direct_spans_per_s"]
    print(
        f"in-process parse + insert, no HTTP: {result['direct_spans_per_s']:,.0f} spans/s; "
        f"collector / in-process = {ratio:.2f}"
    )
    return result


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=200_000)
    parser.add_argument("--senders", type=int, default=3)
    args = parser.parse_args()
    bench_collector(args.spans, args.senders)


if __name__ == "__main__":
    main()
