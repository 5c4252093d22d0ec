"""A running collector seen from outside its process (collector.py is the process itself).

`CollectorClient(url)` asks for the collector's counts (`stats`), has it insert every span it
accepted (`flush`), and runs one SELECT on the trace: `query` returns JSON rows, `df` a DataFrame
with the column dtypes a finished file gives. For `df` the collector answers in Arrow and DuckDB
turns that into the DataFrame, as `TraceStore.df` does from a file: JSON rows would lose int32,
nullable integers and HUGEINT sums.
"""

from __future__ import annotations

import functools
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa


class CollectorClient:
    """Talks to a running collector: stats, flush, and queries as rows or DataFrames."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _send(self, method: str, path: str, payload: Any = None) -> bytes:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            raise RuntimeError(f"collector {method} {path}: {error.code} {detail}") from None

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        return json.loads(self._send(method, path, payload))

    def stats(self) -> dict[str, int]:
        return self._call("GET", "/stats")

    def flush(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return self._call("POST", f"/flush?timeout={timeout_s}", {})

    def query(
        self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        result = self._call("POST", "/query", {"sql": sql, "params": params})
        return [dict(zip(result["columns"], row, strict=True)) for row in result["rows"]]

    def df(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> pd.DataFrame:
        body = self._send("POST", "/query", {"sql": sql, "params": params, "format": "arrow"})
        return arrow_to_frame(pa.ipc.open_stream(body).read_all())


@functools.cache
def _converter() -> duckdb.DuckDBPyConnection:
    return duckdb.connect()  # in memory; ~20 ms to open, so once per process


_converter_lock = threading.Lock()  # cursors are per thread; making one is not thread-safe


def arrow_to_frame(table: pa.Table) -> pd.DataFrame:
    """`table` as a DataFrame made by DuckDB, with the dtypes its `.df()` gives for a query's
    answer (`pa.Table.to_pandas` differs: nullable integers become floats, sums objects)."""
    with _converter_lock:
        cursor = _converter().cursor()
    try:
        return cursor.from_arrow(table).df()
    finally:
        cursor.close()
