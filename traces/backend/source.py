"""Opening a trace to read it: a finished DuckDB file, a running collector's URL, or, inside the
collector process, the collector's own store. Every reader opens traces here: the `stepscope
trace ...` commands and the Perfetto export (`open_trace`), and the dashboard (the three sources).

A source answers `df(sql, params) -> DataFrame` (and `query`, the same, for the dashboard) with
the same column dtypes from a file and from a collector (`CollectorClient.df` has DuckDB make the
DataFrame from an Arrow answer, as `TraceStore.df` does), and says whether it is `live` (spans
still arriving). The questions in queries.py, explain.py and export.py take any `Queryable`: a
source, or a `TraceStore` this process holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import duckdb
import pandas as pd

from stepscope.traces.backend.client import CollectorClient
from stepscope.traces.backend.store import TraceStore

Params = Sequence[Any] | Mapping[str, Any] | None


class Queryable(Protocol):
    """Anything that answers SQL on a trace's views with a DataFrame."""

    def df(self, sql: str, params: Params = None) -> pd.DataFrame: ...


class TraceSource(Queryable, Protocol):
    """A trace opened for reading, with what the dashboard shows of it."""

    live: bool  # spans still arrive
    label: str  # where it reads from, for people

    def query(self, sql: str, params: Params = None) -> pd.DataFrame: ...

    def close(self) -> None: ...


class DuckDBSource:
    """A finished run's trace file, opened read-only (a replay). A path that is no trace file
    raises ValueError."""

    live = False

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.label = f"replay of {os.path.basename(self.path)}"
        if not os.path.isfile(self.path):
            raise ValueError(f"no trace file at {self.path}")
        try:
            self.store = TraceStore(self.path, read_only=True)
        except duckdb.Error as error:
            raise ValueError(f"cannot open {self.path} as a trace file: {error}") from error

    def query(self, sql: str, params: Params = None) -> pd.DataFrame:
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

    def query(self, sql: str, params: Params = None) -> pd.DataFrame:
        return self.client.df(sql, params)

    df = query

    def close(self) -> None:
        pass  # nothing held between queries


class StoreSource:
    """The collector's own `TraceStore`, queried on cursors while its writer thread inserts."""

    live = True

    def __init__(self, store: TraceStore, label: str = "live (collector process)") -> None:
        self.store = store
        self.label = label

    def query(self, sql: str, params: Params = None) -> pd.DataFrame:
        return self.store.df(sql, params)

    df = query

    def close(self) -> None:
        pass  # the collector closes its store


@contextmanager
def open_trace(path_or_url: str, timeout_s: float = 60.0) -> Iterator[TraceSource]:
    """A trace file (read-only) or a running collector's URL, closed on leaving. A path that is
    no trace file raises ValueError (the CLI prints it, with no traceback)."""
    source: TraceSource
    if path_or_url.startswith(("http://", "https://")):
        source = CollectorSource(path_or_url, timeout_s=timeout_s)
    else:
        source = DuckDBSource(path_or_url)
    try:
        yield source
    finally:
        source.close()
