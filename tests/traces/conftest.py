"""Tracing tests: every test leaves this process with tracing off, whatever it initialised."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stepscope.traces import setup
from stepscope.traces.backend.collector_process import (
    start_collector_process,
    stop_collector_process,
)


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
