"""The trace store: spans of every process in one DuckDB file, inserted and queried.

DuckDB allows one writer process, so exactly one process owns a file while spans arrive (the
collector in `stepscope serve`, the notebook kernel in offline runs); a finished file opens
anywhere read-only. Spans go in as column batches through Arrow (`convert.SpanBatch`), never row
by row. The table and the views are `views.py`; `source.py` opens a trace for reading.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import duckdb
import pandas as pd
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from stepscope.traces.backend.convert import SpanBatch
from stepscope.traces.backend.views import COLUMNS, create_schema


class TraceStore:
    """One DuckDB trace file: the `spans` table, the views, batch inserts and queries.

    Open read-write in the one process that owns the file while spans arrive, read-only anywhere
    once it is closed. Queries from other threads go through `cursor()` (one per thread).
    """

    def __init__(self, path: str | os.PathLike[str], read_only: bool = False) -> None:
        self.path = os.fspath(path)
        self.read_only = read_only
        self.con = duckdb.connect(self.path, read_only=read_only)
        self._write_lock = threading.Lock()
        self._cursor_lock = threading.Lock()
        if read_only:
            tables = {
                r[0] for r in self.con.execute("SELECT table_name FROM duckdb_tables()").fetchall()
            }
            if "spans" not in tables:
                self.con.close()
                raise ValueError(f"{self.path} is not a stepscope trace file (no spans table)")
        else:
            create_schema(self.con)

    # -- writing --
    def insert_batch(self, batch: SpanBatch) -> int:
        """Insert a column batch with one statement; returns the number of spans."""
        if not len(batch):
            return 0
        table = batch.to_arrow()
        columns = ", ".join(COLUMNS)
        with self._write_lock:
            self.con.register("_stepscope_batch", table)
            try:
                self.con.execute(
                    f"INSERT INTO spans ({columns}) SELECT {columns} FROM _stepscope_batch"
                )
            finally:
                self.con.unregister("_stepscope_batch")
        return len(batch)

    def insert_spans(self, spans: Iterable[Mapping[str, Any]] | Sequence[ReadableSpan]) -> int:
        """Insert span dicts (keys as in `COLUMNS`) or SDK `ReadableSpan`s."""
        spans = list(spans)
        batch = SpanBatch()
        if spans and isinstance(spans[0], ReadableSpan):
            batch.add_sdk_spans(spans)  # type: ignore[arg-type]
        else:
            batch.add_dicts(spans)  # type: ignore[arg-type]
        return self.insert_batch(batch)

    def insert_otlp(self, request: ExportTraceServiceRequest | bytes) -> int:
        """Insert an OTLP `ExportTraceServiceRequest` (message or serialized bytes)."""
        if isinstance(request, bytes | bytearray | memoryview):
            message = ExportTraceServiceRequest()
            message.ParseFromString(bytes(request))
            request = message
        batch = SpanBatch()
        batch.add_otlp(request)
        return self.insert_batch(batch)

    # -- reading --
    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection to the same database for use on another thread."""
        with self._cursor_lock:
            return self.con.cursor()

    def df(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> pd.DataFrame:
        cur = self.cursor()
        try:
            return cur.execute(sql, params).df()
        finally:
            cur.close()

    def query(
        self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        cur = self.cursor()
        try:
            result = cur.execute(sql, params)
            columns = [d[0] for d in result.description or ()]
            return [dict(zip(columns, row, strict=True)) for row in result.fetchall()]
        finally:
            cur.close()

    def count(self, name: str | None = None) -> int:
        if name is None:
            return self.query("SELECT count(*) AS n FROM spans")[0]["n"]
        return self.query("SELECT count(*) AS n FROM spans WHERE name = ?", [name])[0]["n"]

    # -- closing --
    def close(self) -> None:
        """Checkpoint (so the file needs no WAL replay) and close."""
        with self._write_lock:
            if not self.read_only:
                self.con.execute("CHECKPOINT")
            self.con.close()

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DuckDBSpanExporter(SpanExporter):
    """Exports spans straight into a DuckDB trace file: this process owns the file (an offline
    `LLM` running in one process, a notebook). Pass it to `init_tracing(exporters=[...])`."""

    def __init__(self, db_path: str | os.PathLike[str]) -> None:
        self.store = TraceStore(db_path)
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        batch = SpanBatch()
        batch.add_sdk_spans(spans)
        self.store.insert_batch(batch)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.store.close()
