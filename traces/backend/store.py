"""The trace store: spans of every process in one DuckDB file, plus the views that read them.

DuckDB allows one writer process, so exactly one process owns a file while spans arrive (the
collector in `stepscope serve`, the notebook kernel in offline runs); a finished file opens
anywhere read-only. Spans go in as column batches through Arrow, never row by row.

Table `spans` holds one row per span (ids as lowercase hex, attributes/events/links/resource as
JSON). The views `requests`, `steps`, `crossings`, `step_requests`, `worker_steps` and
`dp_loads` are the contract the dashboard, CLI and tutorials read; docs/tracing.md lists their
columns.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from stepscope.traces import names as n

COLUMNS = (
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "kind",
    "service_name",
    "rank",
    "start_ns",
    "end_ns",
    "duration_ns",
    "status",
    "attributes",
    "events",
    "links",
    "resource",
)

ARROW_SCHEMA = pa.schema(
    [
        ("trace_id", pa.string()),
        ("span_id", pa.string()),
        ("parent_span_id", pa.string()),
        ("name", pa.string()),
        ("kind", pa.string()),
        ("service_name", pa.string()),
        ("rank", pa.int32()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("duration_ns", pa.int64()),
        ("status", pa.string()),
        ("attributes", pa.string()),
        ("events", pa.string()),
        ("links", pa.string()),
        ("resource", pa.string()),
    ]
)

CREATE_SPANS = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id VARCHAR NOT NULL,
    span_id VARCHAR NOT NULL,
    parent_span_id VARCHAR,
    name VARCHAR NOT NULL,
    kind VARCHAR,
    service_name VARCHAR,
    rank INTEGER,
    start_ns BIGINT,
    end_ns BIGINT,
    duration_ns BIGINT,
    status VARCHAR,
    attributes JSON,
    events JSON,
    links JSON,
    resource JSON
)
"""

# OTLP enum values, by number.
_OTLP_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
_OTLP_STATUS = ("UNSET", "OK", "ERROR")
_EMPTY_LIST = "[]"
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


# ---- views ------------------------------------------------------------------------------------
def _num(key: str, sql_type: str = "BIGINT", column: str = "attributes") -> str:
    return f"""CAST(json_extract({column}, '$."{key}"') AS {sql_type})"""


def _str(key: str, column: str = "attributes") -> str:
    return f"""json_extract_string({column}, '$."{key}"')"""


def _event_ns(event: str) -> str:
    """Time of the first event named `event` of a span, in ns (NULL when absent)."""
    return (
        "list_min([CAST(json_extract(e, '$.time_ns') AS BIGINT) "
        f"FOR e IN CAST(events AS JSON[]) IF json_extract_string(e, '$.name') = '{event}'])"
    )


def _dp_rank(prefix: str = "") -> str:
    """The data-parallel rank of a span: its own attribute (API-side spans name the rank they
    talk to), else its process's (engine cores and workers), else 0 (one rank only)."""
    return (
        f"coalesce({_num(n.DP_RANK, 'INTEGER', column=prefix + 'attributes')}, "
        f"{_num(n.DP_RANK, 'INTEGER', column=prefix + 'resource')}, 0)"
    )


def _array_len(key: str) -> str:
    return f"""coalesce(json_array_length(attributes, '$."{key}"'), 0)"""


VIEWS = {
    "requests": f"""
WITH r AS (
    SELECT *,
        {_event_ns(n.RequestEvent.QUEUED)} AS queued_ns,
        {_event_ns(n.RequestEvent.SCHEDULED)} AS scheduled_ns,
        {_event_ns(n.RequestEvent.FIRST_TOKEN)} AS first_token_ns,
        {_event_ns(n.RequestEvent.FINISHED)} AS finished_ns
    FROM spans WHERE name = '{n.REQUEST}'
)
SELECT
    {_str(n.REQUEST_ID)} AS request_id,
    trace_id,
    span_id,
    {_str(n.GEN_AI_REQUEST_MODEL)} AS model,
    {_str(n.GEN_AI_OPERATION_NAME)} AS operation,
    start_ns,
    end_ns,
    queued_ns,
    scheduled_ns,
    first_token_ns,
    finished_ns,
    (scheduled_ns - queued_ns) / 1e9 AS queue_time_s,
    (first_token_ns - start_ns) / 1e9 AS ttft_s,
    (end_ns - start_ns) / 1e9 AS e2e_s,
    {_num(n.GEN_AI_USAGE_INPUT_TOKENS)} AS input_tokens,
    {_num(n.GEN_AI_USAGE_OUTPUT_TOKENS)} AS output_tokens,
    {_num(n.NUM_CACHED_TOKENS)} AS cached_tokens,
    {_num(n.NUM_PREEMPTIONS)} AS num_preemptions,
    json_extract_string(attributes, '$."{n.GEN_AI_RESPONSE_FINISH_REASONS}"[0]') AS finish_reason,
    {_dp_rank()} AS dp_rank
FROM r
""",
    "steps": f"""
SELECT
    {_num(n.STEP)} AS step,
    start_ns,
    end_ns,
    duration_ns / 1e9 AS duration_s,
    {_num(n.NUM_RUNNING)} AS num_running,
    {_num(n.NUM_WAITING)} AS num_waiting,
    {_num(n.NUM_DECODE_TOKENS)} AS num_decode_tokens,
    {_num(n.NUM_PREFILL_TOKENS)} AS num_prefill_tokens,
    {_num(n.TOKEN_BUDGET)} AS token_budget,
    {_num(n.KV_FREE_BEFORE)} AS kv_free_before,
    {_num(n.KV_FREE_AFTER)} AS kv_free_after,
    {_num(n.KV_TOTAL_BLOCKS)} AS kv_total_blocks,
    {_num(n.PREFIX_HIT_TOKENS)} AS prefix_hit_tokens,
    {_str(n.WAITING_REASON)} AS waiting_reason,
    coalesce({_num(n.WAITING_REASON_COUNT)}, 0) AS waiting_reason_count,
    coalesce({_num(n.KV_BLOCKS_SHORT)}, 0) AS kv_blocks_short,
    {_array_len(n.PREEMPTED_IDS)} AS num_preempted,
    {_array_len(n.FINISHED_IDS)} AS num_finished,
    {_dp_rank()} AS dp_rank,
    trace_id,
    span_id
FROM spans WHERE name = '{n.ENGINE_STEP}'
""",
    "crossings": f"""
SELECT
    {_str(n.BOUNDARY)} AS boundary,
    CASE name WHEN '{n.SEND}' THEN 'send' ELSE 'receive' END AS side,
    {_str(n.MESSAGE_TYPE)} AS message_type,
    {_num(n.MESSAGE_BODY_SIZE)} AS bytes,
    {_num(n.NUM_REQUESTS)} AS num_requests,
    start_ns,
    end_ns,
    trace_id,
    span_id,
    parent_span_id,
    service_name,
    rank,
    {_dp_rank()} AS dp_rank
FROM spans WHERE name IN ('{n.SEND}', '{n.RECEIVE}')
""",
    "step_requests": f"""
SELECT
    step, unnest(ids) AS request_id, unnest(num_tokens) AS num_tokens, start_ns, end_ns, dp_rank
FROM (
    SELECT
        {_num(n.STEP)} AS step,
        {_dp_rank()} AS dp_rank,
        coalesce({_num(n.REQUEST_IDS, "VARCHAR[]")}, []) AS ids,
        coalesce({_num(n.REQUEST_NUM_TOKENS, "BIGINT[]")}, []) AS num_tokens,
        start_ns,
        end_ns
    FROM spans WHERE name = '{n.ENGINE_STEP}'
)
""",
    "worker_steps": f"""
SELECT
    {_num(n.STEP, column="w.attributes")} AS step,
    coalesce({_num(n.RANK, "INTEGER", column="w.attributes")}, w.rank) AS rank,
    {_dp_rank("w.")} AS dp_rank,
    w.start_ns,
    w.end_ns,
    sum(c.duration_ns) FILTER (WHERE c.name = '{n.PREPARE_INPUTS}') / 1e9 AS prepare_s,
    sum(c.duration_ns) FILTER (WHERE c.name = '{n.FORWARD}') / 1e9 AS forward_s,
    sum(c.duration_ns) FILTER (WHERE c.name = '{n.SAMPLE}') / 1e9 AS sample_s
FROM spans w
LEFT JOIN spans c ON c.parent_span_id = w.span_id AND c.trace_id = w.trace_id
WHERE w.name = '{n.WORKER_STEP}'
GROUP BY w.trace_id, w.span_id, w.attributes, w.resource, w.rank, w.start_ns, w.end_ns
""",
    # One row per DP rank per publication of the DP coordinator: the load the API servers
    # routed by (the arrays of a `stepscope.dp_publish` span are indexed by rank).
    "dp_loads": f"""
SELECT
    time_ns,
    CAST(unnest(range(len(waiting))) AS INTEGER) AS dp_rank,
    unnest(waiting) AS num_waiting,
    unnest(running) AS num_running,
    unnest(lost) = 1 AS lost,
    unnest(age_ms) / 1e3 AS report_age_s,
    trace_id,
    span_id
FROM (
    SELECT
        start_ns AS time_ns,
        coalesce({_num(n.DP_NUM_WAITING, "BIGINT[]")}, []) AS waiting,
        coalesce({_num(n.DP_NUM_RUNNING, "BIGINT[]")}, []) AS running,
        coalesce({_num(n.DP_LOST, "BIGINT[]")}, []) AS lost,
        coalesce({_num(n.DP_REPORT_AGE_MS, "BIGINT[]")}, []) AS age_ms,
        trace_id,
        span_id
    FROM spans WHERE name = '{n.DP_PUBLISH}'
)
""",
}


# ---- column batches -----------------------------------------------------------------------------
class SpanBatch:
    """Spans as parallel column lists, ready to become one Arrow table and one INSERT."""

    __slots__ = COLUMNS

    def __init__(self) -> None:
        for column in COLUMNS:
            setattr(self, column, [])

    def __len__(self) -> int:
        return len(self.span_id)

    def extend(self, other: SpanBatch) -> None:
        for column in COLUMNS:
            getattr(self, column).extend(getattr(other, column))

    def to_arrow(self) -> pa.Table:
        return pa.table([getattr(self, c) for c in COLUMNS], schema=ARROW_SCHEMA)

    def _append(
        self,
        trace_id: str,
        span_id: str,
        parent_span_id: str | None,
        name: str,
        kind: str,
        service_name: str | None,
        rank: int | None,
        start_ns: int,
        end_ns: int,
        status: str,
        attributes: str,
        events: str,
        links: str,
        resource: str,
    ) -> None:
        self.trace_id.append(trace_id)
        self.span_id.append(span_id)
        self.parent_span_id.append(parent_span_id)
        self.name.append(name)
        self.kind.append(kind)
        self.service_name.append(service_name)
        self.rank.append(rank)
        self.start_ns.append(start_ns)
        self.end_ns.append(end_ns)
        self.duration_ns.append(end_ns - start_ns)
        self.status.append(status)
        self.attributes.append(attributes)
        self.events.append(events)
        self.links.append(links)
        self.resource.append(resource)

    # -- from the OpenTelemetry SDK (in-process DuckDB exporter) --
    def add_sdk_spans(self, spans: Iterable[ReadableSpan]) -> None:
        resource_cache: dict[int, tuple[str | None, int | None, str]] = {}
        for span in spans:
            res = resource_cache.get(id(span.resource))
            if res is None:
                attrs = dict(span.resource.attributes)
                res = (attrs.get(n.SERVICE_NAME), attrs.get(n.RANK), _encode(attrs))
                resource_cache[id(span.resource)] = res
            ctx = span.context
            parent = span.parent
            attributes = dict(span.attributes or {})
            rank = res[1] if res[1] is not None else attributes.get(n.RANK)
            events = (
                _encode(
                    [
                        {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes)}
                        for e in span.events
                    ]
                )
                if span.events
                else _EMPTY_LIST
            )
            links = (
                _encode(
                    [
                        {
                            "trace_id": f"{link.context.trace_id:032x}",
                            "span_id": f"{link.context.span_id:016x}",
                            "attributes": dict(link.attributes or {}),
                        }
                        for link in span.links
                    ]
                )
                if span.links
                else _EMPTY_LIST
            )
            self._append(
                f"{ctx.trace_id:032x}",
                f"{ctx.span_id:016x}",
                f"{parent.span_id:016x}" if parent is not None else None,
                span.name,
                span.kind.name,
                res[0],
                rank,
                span.start_time,
                span.end_time,
                span.status.status_code.name,
                _encode(attributes),
                events,
                links,
                res[2],
            )

    # -- from OTLP protobuf (the collector) --
    def add_otlp(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            res = _otlp_attributes(resource_spans.resource.attributes)
            service_name = res.get(n.SERVICE_NAME)
            resource_rank = res.get(n.RANK)
            resource_json = _encode(res)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = _otlp_attributes(span.attributes)
                    rank = resource_rank if resource_rank is not None else attributes.get(n.RANK)
                    events = (
                        _encode(
                            [
                                {
                                    "name": e.name,
                                    "time_ns": e.time_unix_nano,
                                    "attributes": _otlp_attributes(e.attributes),
                                }
                                for e in span.events
                            ]
                        )
                        if span.events
                        else _EMPTY_LIST
                    )
                    links = (
                        _encode(
                            [
                                {
                                    "trace_id": link.trace_id.hex(),
                                    "span_id": link.span_id.hex(),
                                    "attributes": _otlp_attributes(link.attributes),
                                }
                                for link in span.links
                            ]
                        )
                        if span.links
                        else _EMPTY_LIST
                    )
                    self._append(
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex() or None,
                        span.name,
                        _OTLP_KINDS[span.kind],
                        service_name,
                        rank,
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        _OTLP_STATUS[span.status.code],
                        _encode(attributes),
                        events,
                        links,
                        resource_json,
                    )

    # -- from plain dicts (tests, imports) --
    def add_dicts(self, spans: Iterable[Mapping[str, Any]]) -> None:
        for span in spans:
            start_ns = int(span["start_ns"])
            end_ns = int(span["end_ns"])
            self._append(
                span["trace_id"],
                span["span_id"],
                span.get("parent_span_id"),
                span["name"],
                span.get("kind", "INTERNAL"),
                span.get("service_name"),
                span.get("rank"),
                start_ns,
                end_ns,
                span.get("status", "UNSET"),
                _json_text(span.get("attributes"), "{}"),
                _json_text(span.get("events"), _EMPTY_LIST),
                _json_text(span.get("links"), _EMPTY_LIST),
                _json_text(span.get("resource"), "{}"),
            )


def _json_text(value: Any, empty: str) -> str:
    if value is None:
        return empty
    return value if isinstance(value, str) else _encode(value)


def _otlp_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_otlp_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _otlp_attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return None if kind is None else getattr(value, kind)


def _otlp_attributes(key_values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in key_values:
        value = kv.value
        kind = value.WhichOneof("value")
        # Scalars inline: this loop runs for every attribute the collector receives.
        if kind == "string_value" or kind == "int_value" or kind == "double_value":
            out[kv.key] = getattr(value, kind)
        else:
            out[kv.key] = _otlp_value(value)
    return out


# ---- the store -----------------------------------------------------------------------------------
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
            self.con.execute(CREATE_SPANS)
            for view, sql in VIEWS.items():
                self.con.execute(f"CREATE OR REPLACE VIEW {view} AS {sql}")

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
