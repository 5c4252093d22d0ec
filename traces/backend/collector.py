"""The collector process: receives every process's spans over OTLP/HTTP and owns the DuckDB file.

DuckDB allows one writer process, so in `stepscope serve` this process alone opens the trace file:
HTTP threads parse `ExportTraceServiceRequest`s into column batches, ONE writer thread inserts
them (coalesced, through Arrow), and queries run in this process on their own cursors while spans
keep arriving.

Routes: `POST /v1/traces` (OTLP, application/x-protobuf, gzip or deflate allowed), `GET /stats`,
`POST /query` (one read-only SELECT; JSON `{"sql": ..., "params": [...]}` or the SQL as text;
`GET /query?sql=...` too; JSON rows, or with `"format": "arrow"` an Arrow IPC stream),
`POST /flush` (wait until every accepted span is in the file), `POST /report` (a process's span
counts as it stops) and `GET /health`. `client.CollectorClient` calls them from other processes.
Other code in this process (the Panel dashboard) adds routes with `add_route` or runs beside it
through `run_collector(extensions=["module:function"])`.

Started by a parent (`start_collector_process`), the collector is the last process of a run to
stop: it ignores SIGINT, SIGHUP and SIGTERM, which a terminal or a process manager may send to
the whole process group while the other processes still export, and closes the file when its
parent says so (by closing the collector's stdin, once every other process has flushed) or is
gone. Its last line on stdout holds the run's span counts, for the parent's closing line.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import duckdb
import pyarrow as pa
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from stepscope.traces import names as n
from stepscope.traces.backend.convert import SpanBatch
from stepscope.traces.backend.store import TraceStore
from stepscope.traces.process import watch_parent

logger = logging.getLogger(__name__)

MAX_QUEUED_BATCHES = 1024  # one batch per export request: ~2M spans at the SDK's batch size
MAX_INSERT_ROWS = 65_536  # the writer coalesces queued batches up to this many spans per INSERT
QUEUE_FULL_WAIT_S = 5.0  # an export waits this long for room before it is told to retry
# Each INSERT costs ~2 ms of CPU whatever its size, and the engine's processes export every two
# seconds: the writer gathers what arrives within this window into one INSERT (a flush or close
# cuts the wait short), so tracing takes fewer cycles from the model on a small machine.
INSERT_INTERVAL_S = 1.0
COALESCE_ROWS = 4096  # a writer holding fewer spans than this waits INSERT_INTERVAL_S for more
# The collector is bookkeeping: at this niceness it yields the cores to the engine's processes
# and catches up in their gaps (its queue holds minutes of spans; nothing is dropped meanwhile).
COLLECTOR_NICE = 10
ARROW_STREAM = "application/vnd.apache.arrow.stream"  # a `/query` answer with "format": "arrow"


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Mapping[str, str]
    body: bytes


@dataclass(slots=True)
class HttpResponse:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, value: Any, status: int = 200) -> HttpResponse:
        return cls(status, json.dumps(value, default=str).encode())


Handler = Callable[[HttpRequest], HttpResponse]


class Collector:
    """OTLP/HTTP receiver + single DuckDB writer + query endpoint, in one process."""

    def __init__(self, db_path: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = TraceStore(db_path)
        # /query runs SQL from the network: no file or extension access from inside DuckDB.
        self.store.con.execute("SET enable_external_access = false")
        # One DuckDB thread: a parallel INSERT of a few hundred spans would wake a second thread
        # and take a core from the model for less than it saves.
        self.store.con.execute("SET threads = 1")
        self.received = 0
        self.inserted = 0
        self.dropped = 0
        self.rejected = 0
        self.bad_requests = 0
        self.senders: dict[int, str] = {}  # process.pid -> service.name of every span sender
        self.reports: dict[int, dict[str, Any]] = {}  # process.pid -> its counts as it stopped
        self._counts_lock = threading.Lock()
        self._queue: queue.Queue[SpanBatch | None] = queue.Queue(MAX_QUEUED_BATCHES)
        self._insert_now = threading.Event()  # set by flush/close: insert without waiting
        self._closing = False
        self._submit_lock = threading.Lock()  # no batch enters the queue after close() began
        self._routes: dict[tuple[str, str], Handler] = {}
        self._prefix_routes: list[tuple[str, str, Handler]] = []
        self.add_route("POST", "/v1/traces", self._handle_traces)
        self.add_route("GET", "/stats", lambda _: HttpResponse.json(self.stats()))
        self.add_route("GET", "/health", lambda _: HttpResponse.json({"ok": True}))
        self.add_route("POST", "/query", self._handle_query)
        self.add_route("GET", "/query", self._handle_query)
        self.add_route("POST", "/flush", self._handle_flush)
        self.add_route("POST", "/report", self._handle_report)
        self.server = ThreadingHTTPServer((host, port), _RequestHandler)
        self.server.daemon_threads = True
        self.server.collector = self  # type: ignore[attr-defined]
        self._writer = threading.Thread(target=self._write_loop, name="trace-writer", daemon=True)
        self._serve_thread = threading.Thread(
            target=self.server.serve_forever, name="trace-http", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add_route(self, method: str, path: str, handler: Handler, *, prefix: bool = False) -> None:
        """Serve `handler` for `method path` (or every path under `path` with `prefix=True`)."""
        if prefix:
            self._prefix_routes.append((method.upper(), path, handler))
        else:
            self._routes[(method.upper(), path)] = handler

    def route(self, method: str, path: str) -> Handler | None:
        handler = self._routes.get((method, path))
        if handler is None:
            for route_method, route_path, prefix_handler in self._prefix_routes:
                if route_method == method and path.startswith(route_path):
                    return prefix_handler
        return handler

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._writer.start()
        self._serve_thread.start()

    def close(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stop taking spans, insert every accepted one, checkpoint and close the file; returns
        the run's counts (`summary`)."""
        with self._submit_lock:
            self._closing = True
        self.server.shutdown()
        self.server.server_close()
        self._queue.put(None)
        self._insert_now.set()
        self._writer.join(timeout_s)
        self.store.close()
        summary = self.summary()
        logger.info("collector closed: %s", summary)
        return summary

    def summary(self) -> dict[str, Any]:
        """Spans in the file, and spans lost on the way to it: those its senders reported lost
        (full queue, failed export) plus those the writer failed to insert. A process that sent
        spans and never reported (it was killed) is named in `silent`."""
        with self._counts_lock:
            reports = dict(self.reports)
            silent = {pid: svc for pid, svc in self.senders.items() if pid not in reports}
            lost_by = {
                f"{r['service']} (pid {pid})": r["lost"] for pid, r in reports.items() if r["lost"]
            }
            return {
                "spans": self.inserted,
                "lost": sum(lost_by.values()) + self.dropped,
                "lost_by": lost_by,
                "insert_failed": self.dropped,
                "processes": len(self.senders.keys() | reports.keys()),
                "silent": [f"{svc} (pid {pid})" for pid, svc in silent.items()],
            }

    # ---- ingestion ------------------------------------------------------------------------
    def _handle_traces(self, request: HttpRequest) -> HttpResponse:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type != "application/x-protobuf":
            return HttpResponse.json({"error": "only application/x-protobuf is accepted"}, 415)
        body = request.body
        encoding = request.headers.get("Content-Encoding", "").lower()
        message = ExportTraceServiceRequest()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            message.ParseFromString(body)
        except (DecodeError, OSError, zlib.error) as error:
            with self._counts_lock:
                self.bad_requests += 1
            return HttpResponse.json({"error": f"bad OTLP request: {error}"}, 400)
        batch = SpanBatch()
        batch.add_otlp(message)
        self._note_senders(message)
        if not self.submit(batch):
            return HttpResponse(503, b"", headers={"Retry-After": "1"})
        return HttpResponse(
            200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf"
        )

    def _note_senders(self, message: ExportTraceServiceRequest) -> None:
        for resource_spans in message.resource_spans:
            pid, service = None, ""
            for kv in resource_spans.resource.attributes:
                if kv.key == n.PROCESS_PID:
                    pid = kv.value.int_value
                elif kv.key == n.SERVICE_NAME:
                    service = kv.value.string_value
            if pid is not None and pid not in self.senders:
                with self._counts_lock:
                    self.senders[pid] = service

    def _handle_report(self, request: HttpRequest) -> HttpResponse:
        try:
            report = json.loads(request.body)
            pid = int(report["pid"])
            counts = {
                "service": str(report["service"]),
                "ended": int(report["ended"]),
                "lost": int(report["lost"]),
            }
        except (ValueError, KeyError, TypeError) as error:
            return HttpResponse.json({"error": f"bad report: {error!r}"}, 400)
        with self._counts_lock:
            self.reports[pid] = counts
        if counts["lost"]:
            logger.warning(
                "collector: %s (pid %d) lost %d of its %d spans",
                counts["service"],
                pid,
                counts["lost"],
                counts["ended"],
            )
        return HttpResponse.json({"ok": True})

    def submit(self, batch: SpanBatch) -> bool:
        """Queue a batch for the writer; False (counted as rejected) when full or closing."""
        count = len(batch)
        try:
            with self._submit_lock:
                if self._closing:
                    raise queue.Full
                self._queue.put(batch, timeout=QUEUE_FULL_WAIT_S)
        except queue.Full:
            with self._counts_lock:
                self.rejected += count
            logger.warning("collector: queue full or closing, %d spans refused", count)
            return False
        with self._counts_lock:
            self.received += count
        return True

    def _write_loop(self) -> None:
        stop = False
        while not stop:
            batch = SpanBatch()
            item = self._queue.get()
            taken = 1
            if item is None:
                stop = True
            else:
                batch.extend(item)
            taken, stop = self._drain(batch, taken, stop)
            if not stop and len(batch) < COALESCE_ROWS:
                # A trickle (the engine exporting every few seconds): wait for more to arrive,
                # so that one INSERT carries what several exports brought.
                self._insert_now.wait(INSERT_INTERVAL_S)
                self._insert_now.clear()  # before draining: a later flush wakes the next wait
                taken, stop = self._drain(batch, taken, stop)
            self._insert(batch)
            for _ in range(taken):
                self._queue.task_done()

    def _drain(self, batch: SpanBatch, taken: int, stop: bool) -> tuple[int, bool]:
        """Add every batch already queued (up to MAX_INSERT_ROWS spans) to `batch`."""
        while not stop and len(batch) < MAX_INSERT_ROWS:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            taken += 1
            if item is None:
                stop = True
            else:
                batch.extend(item)
        return taken, stop

    def _insert(self, batch: SpanBatch) -> None:
        if not len(batch):
            return
        try:
            self.store.insert_batch(batch)
        except Exception:
            logger.exception("collector: insert of %d spans failed", len(batch))
            with self._counts_lock:
                self.dropped += len(batch)
            return
        with self._counts_lock:
            self.inserted += len(batch)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every accepted span is inserted."""
        deadline = time.monotonic() + timeout_s
        self._insert_now.set()
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._queue.all_tasks_done.wait(remaining):
                    return False
        return True

    def _handle_flush(self, request: HttpRequest) -> HttpResponse:
        timeout_s = float(request.query.get("timeout", ["60"])[0])
        return HttpResponse.json({"flushed": self.flush(timeout_s), **self.stats()})

    def stats(self) -> dict[str, int]:
        with self._counts_lock:
            return {
                "received": self.received,
                "inserted": self.inserted,
                "dropped": self.dropped,
                "rejected": self.rejected,
                "bad_requests": self.bad_requests,
                "queued_batches": self._queue.qsize(),
            }

    # ---- queries ----------------------------------------------------------------------------
    def query(
        self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only SELECT on its own cursor; returns (columns, rows)."""
        with self._select(sql) as cursor:
            result = cursor.execute(sql, params)
            columns = [d[0] for d in result.description or ()]
            return columns, result.fetchall()

    def query_arrow(
        self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None
    ) -> pa.Table:
        """The same, as an Arrow table: the columns keep their types (`CollectorClient.df`)."""
        with self._select(sql) as cursor:
            return cursor.sql(sql, params=params).to_arrow_table()

    @contextlib.contextmanager
    def _select(self, sql: str) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor of its own for `sql`, which must be one SELECT (PermissionError if not)."""
        cursor = self.store.cursor()
        try:
            statements = cursor.extract_statements(sql)
            if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
                raise PermissionError("only a single SELECT statement is allowed")
            yield cursor
        finally:
            cursor.close()

    def _handle_query(self, request: HttpRequest) -> HttpResponse:
        params, fmt = None, request.query.get("format", ["json"])[0]
        if request.method == "GET":
            sql = request.query.get("sql", [""])[0]
        elif request.headers.get("Content-Type", "").startswith("application/json"):
            payload = json.loads(request.body or b"{}")
            sql, params = payload.get("sql", ""), payload.get("params")
            fmt = payload.get("format", fmt)
        else:
            sql = request.body.decode()
        try:
            if fmt == "arrow":
                return HttpResponse(200, _arrow_stream(self.query_arrow(sql, params)), ARROW_STREAM)
            columns, rows = self.query(sql, params)
        except PermissionError as error:
            return HttpResponse.json({"error": str(error)}, 403)
        except duckdb.Error as error:
            return HttpResponse.json({"error": str(error)}, 400)
        return HttpResponse.json({"columns": columns, "rows": rows})


def _arrow_stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: each exporter reuses one connection
    timeout = 120  # idle keep-alive connections close after this

    def _dispatch(self) -> None:
        collector: Collector = self.server.collector  # type: ignore[attr-defined]
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        handler = collector.route(self.command, url.path)
        if handler is None:
            response = HttpResponse.json({"error": f"no route {self.command} {url.path}"}, 404)
        else:
            request = HttpRequest(
                self.command, url.path, urllib.parse.parse_qs(url.query), self.headers, body
            )
            try:
                response = handler(request)
            except Exception as error:
                logger.exception("collector: %s %s failed", self.command, url.path)
                response = HttpResponse.json({"error": repr(error)}, 500)
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for key, value in response.headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(response.body)

    do_GET = do_POST = do_PUT = do_DELETE = _dispatch

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("collector http: " + format, *args)


# ---- the process ------------------------------------------------------------------------------
def _load(spec: str) -> Callable[[Collector], None]:
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


def run_collector(
    db_path: str,
    host: str = "127.0.0.1",
    port: int = 0,
    ready_queue: Any = None,
    extensions: Sequence[str] = (),
    parent_pid: int | None = None,
) -> None:
    """The collector process's main: serve until told to stop, then flush and close the file.

    Alone, SIGTERM or SIGINT stops it. With a `parent_pid`, it stops when its stdin reaches its
    end (the parent closed it, or died) or the parent is gone, and ignores the signals a
    terminal or a process manager sends the whole process group. Puts `("ready", url)` (or
    `("error", message)`) on `ready_queue`, and `("closed", counts)` once the file is closed.
    Each extension `"module:function"` is called with the `Collector` before serving (e.g. to
    add dashboard routes or start a Panel server thread that queries `collector.store.cursor()`).
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s collector %(message)s")
    try:
        collector = Collector(db_path, host, port)
        for spec in extensions:
            _load(spec)(collector)
    except Exception as error:
        if ready_queue is not None:
            ready_queue.put(("error", f"{type(error).__name__}: {error}"))
        raise
    stop = threading.Event()
    if parent_pid is not None:
        watch_parent(parent_pid, stop.set)
        threading.Thread(target=_stop_at_stdin_end, args=(stop,), daemon=True).start()
    elif threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    collector.start()
    logger.info("collector listening on %s, writing %s", collector.url, db_path)
    if ready_queue is not None:
        ready_queue.put(("ready", collector.url))
    while not stop.wait(0.5):
        pass
    summary = collector.close()
    if ready_queue is not None:
        ready_queue.put(("closed", json.dumps(summary)))


def _stop_at_stdin_end(stop: threading.Event) -> None:
    """Read stdin until its end: the parent closed it (stop now) or died."""
    with contextlib.suppress(OSError, ValueError):
        while sys.stdin.buffer.read(4096):
            pass
    stop.set()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="stepscope trace collector (OTLP/HTTP -> DuckDB)")
    parser.add_argument("db_path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--extension", action="append", default=[], help="module:function")
    parser.add_argument(
        "--announce", action="store_true", help="print 'ready URL' on stdout once listening"
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it is gone")
    parser.add_argument(
        "--nice", type=int, default=COLLECTOR_NICE, help="niceness increment (0: none)"
    )
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)  # before any thread starts: on Linux each thread has its own
    if args.parent_pid is not None:
        # The parent stops the collector last, once the others have flushed: the signals a
        # terminal or process manager sends the whole group are not for it.
        for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    run_collector(
        args.db_path,
        args.host,
        args.port,
        ready_queue=_Announcer() if args.announce else None,
        extensions=args.extension,
        parent_pid=args.parent_pid,
    )


class _Announcer:
    """Stands in for a queue: writes the readiness and closing messages on stdout for the
    parent. Anything else printed on stdout (by an extension) goes to stderr instead, so that
    nothing fills the pipe that the parent reads only at start and at close."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def put(self, item: tuple[str, str]) -> None:
        kind, value = item
        print(f"{kind} {value}", file=self.out, flush=True)


if __name__ == "__main__":
    main()
