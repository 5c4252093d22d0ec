"""Tracing tests: every test leaves this process with tracing off, whatever it initialised; the
session's traced runs (tests/conftest.py) opened as trace stores."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stepscope.traces import setup
from stepscope.traces.backend.collector_process import (
    start_collector_process,
    stop_collector_process,
)
from stepscope.traces.backend.store import TraceStore


@pytest.fixture(autouse=True)
def tracing_off_after_test() -> Iterator[None]:
    yield
    setup.shutdown_tracing()


@pytest.fixture
def collector(tmp_path) -> Iterator[tuple[object, str, str]]:
    """A real collector process on 127.0.0.1: (process, url, db_path)."""
    db_path = str(tmp_path / "collector.duckdb")
    process, url = start_collector_process(db_path)
    try:
        yield process, url, db_path
    finally:
        stop_collector_process(process)


@pytest.fixture(scope="module")
def tp2_store(traced_tp2_run) -> Iterator[TraceStore]:
    """The session's TP=2 run's trace file (tests/traced_runs.py), read-only, one per module."""
    store = TraceStore(traced_tp2_run.path, read_only=True)
    yield store
    store.close()


@pytest.fixture(scope="module")
def dp2_store(traced_dp2_run) -> Iterator[TraceStore]:
    """The session's DP=2 run's trace file (tests/traced_runs.py), read-only, one per module."""
    store = TraceStore(traced_dp2_run, read_only=True)
    yield store
    store.close()
