"""Dashboard test fixtures: sources over the session's real traced runs (tests/conftest.py) and
dashboard servers. The browser is the session's (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepscope.traces.backend.source import DuckDBSource
from stepscope.traces.process import free_port
from tests.process_tree import ProcessTree

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"


@pytest.fixture(scope="module")
def source(traced_tp2_run) -> Iterator[DuckDBSource]:
    """The TP=2 run's trace file (the dashboard tests' trace), read as the dashboard reads it
    (one per module)."""
    src = DuckDBSource(traced_tp2_run.path)
    yield src
    src.close()


@pytest.fixture(scope="module")
def dp2_source(traced_dp2_run) -> Iterator[DuckDBSource]:
    """The DP=2 run's trace file, read as the dashboard reads it (one per module)."""
    src = DuckDBSource(traced_dp2_run)
    yield src
    src.close()


def wait_http(
    url: str,
    timeout_s: float = 60.0,
    process: subprocess.Popen | None = None,
    request_timeout_s: float = 30.0,
) -> None:
    """Poll `url` until it answers 200; `request_timeout_s` bounds one try (a dashboard page is
    built per request: seconds on a busy 2-core machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=request_timeout_s) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"dashboard server exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not up after {timeout_s} s")
        time.sleep(0.2)


class DashboardServer:
    """`python -m stepscope.viz.dashboard ...` in a subprocess on a free port."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "stepscope.viz.dashboard", *args, "--port", str(self.port)],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait(self) -> DashboardServer:
        try:
            wait_http(self.url, process=self.process)
        except Exception:
            self.stop()
            raise RuntimeError(f"dashboard did not start:\n{self.log_path.read_text()}") from None
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@pytest.fixture(scope="module")
def servers(traced_tp2_run, tmp_path_factory) -> Iterator[dict[str, DashboardServer]]:
    """Two dashboards: replaying the trace file, and with no trace at all. Both start at once,
    so their start-up (mostly imports) overlaps."""
    logs = tmp_path_factory.mktemp("logs")
    tree = ProcessTree()
    with tree.adopting():
        started = {
            "replay": DashboardServer(["--db", traced_tp2_run.path], logs / "replay.log"),
            "empty": DashboardServer([], logs / "empty.log"),
        }
    try:
        yield {name: server.wait() for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()
        tree.kill()


@pytest.fixture(scope="module")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
