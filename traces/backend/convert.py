"""Spans into columns: `SpanBatch` holds spans as parallel column lists, one list per column of
the `spans` table, filled from OpenTelemetry SDK spans (a process writing its own file), from
OTLP protobuf (the collector) or from plain dicts (tests, imports), and handed to the store as
one Arrow table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan

from stepscope.traces import names as n
from stepscope.traces.backend.views import COLUMNS

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

# OTLP enum values, by number.
_OTLP_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
_OTLP_STATUS = ("UNSET", "OK", "ERROR")
_EMPTY_LIST = "[]"
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


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
