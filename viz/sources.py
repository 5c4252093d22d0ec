"""Where the dashboard reads spans from: a finished DuckDB file, a running collector, or the
collector's own store when the dashboard runs inside the collector process.

Every source answers `query(sql, params) -> DataFrame` (and `df`, the same, so the functions of
`stepscope.traces.backend.queries` accept it) and says whether it is `live` (spans still arriving).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import pandas as pd

from stepscope.traces.backend.client import CollectorClient
from stepscope.traces.backend.store import TraceStore


class TraceSource(Protocol):
    live: bool
    label: str

    def query(self, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame: ...

    def df(self, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame: ...


class DuckDBSource:
    """A finished run's trace file, opened read-only (a replay)."""

    live = False

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.label = f"replay of {os.path.basename(self.path)}"
        self.store = TraceStore(self.path, read_only=True)

    def query(self, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame:
        return self.store.df(sql, params)

    df = query

    def close(self) -> None:
        self.store.close()


class CollectorSource:
    """A running collector, over its `/query` endpoint (live: spans keep arriving)."""

    live = True

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.client = CollectorClient(url, timeout_s=timeout_s)
        self.url = self.client.url
        self.label = f"live from {self.url}"

    def query(self, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame:
        frame = self.client.df(sql, params)
        # JSON rows lose column types: give numbers back their numeric dtype.
        for column in frame.columns:
            if frame[column].dtype == object and not str(column).endswith("id"):
                converted = pd.to_numeric(frame[column], errors="coerce")
                if converted.notna().sum() == frame[column].notna().sum():
                    frame[column] = converted
        return frame

    df = query


class StoreSource:
    """The collector's own `TraceStore`, queried on cursors while its writer thread inserts."""

    live = True

    def __init__(self, store: TraceStore, label: str = "live (collector process)") -> None:
        self.store = store
        self.label = label

    def query(self, sql: str, params: Sequence[Any] | None = None) -> pd.DataFrame:
        return self.store.df(sql, params)

    df = query
