"""Dashboard test fixtures: a real run's trace file, dashboard servers and a headless Chromium
(Debian's, driven by Playwright; `playwright install` is not needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepscope.traces.backend.store import TraceStore
from stepscope.traces.process import free_port

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


SHARED = "The quick brown fox jumps over the lazy dog. " * 6
PROMPTS = [SHARED + f"Question {i}: " + "tell me about scheduling " * (i % 4) for i in range(8)]

_DESCRIBE = """
SELECT (SELECT count(*) FROM requests) AS requests,
       (SELECT count(*) FROM steps) AS steps,
       (SELECT sum(num_preempted) FROM steps) AS preemptions,
       (SELECT sum(prefix_hit_tokens) FROM steps) AS prefix_hit_tokens,
       (SELECT count(DISTINCT rank) FROM worker_steps) AS workers,
       (SELECT count(DISTINCT boundary) FROM crossings) AS boundaries,
       (SELECT max(num_prefill_tokens) FROM steps) AS max_prefill
"""


@pytest.fixture(scope="session")
def trace_db(tmp_path_factory) -> tuple[str, dict[str, Any]]:
    """A real run's trace file: tiny-llama on the real engine (API side, engine-core process,
    two workers), with a KV pool small enough that requests queue, share a prefix, are chunked
    and get preempted. Returns the path and what the run did."""
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("trace") / "run.duckdb"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(
        model="tiny-llama",
        executor="mp",
        tensor_parallel_size=2,
        num_kv_blocks=14,
        max_num_batched_tokens=64,
        trace_db=path,
    ) as llm:
        llm.generate(PROMPTS, params, use_tqdm=False)
    with TraceStore(path, read_only=True) as store:
        info: dict[str, Any] = {k: int(v) for k, v in store.query(_DESCRIBE)[0].items()}
        preempted = store.query(
            "SELECT request_id, num_preemptions FROM requests WHERE num_preemptions > 0 "
            "ORDER BY start_ns LIMIT 1"
        )
    if preempted:
        info["preempted_request"] = preempted[0]["request_id"]
        info["preempted_times"] = int(preempted[0]["num_preemptions"])
    assert info["requests"] == len(PROMPTS) and info["workers"] == 2 and info["boundaries"] == 4
    assert info["preemptions"] > 0 and info["prefix_hit_tokens"] > 0, info
    assert "preempted_request" in info, "a preemption must show on its request span"
    return str(path), info


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
def servers(trace_db, tmp_path_factory) -> Iterator[dict[str, DashboardServer]]:
    """Two dashboards: replaying the trace file, and with no trace at all. Both start at once,
    so their start-up (mostly imports) overlaps."""
    logs = tmp_path_factory.mktemp("logs")
    started = {
        "replay": DashboardServer(["--db", trace_db[0]], logs / "replay.log"),
        "empty": DashboardServer([], logs / "empty.log"),
    }
    try:
        yield {name: server.wait() for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


def chromium_missing() -> str | None:
    if not os.path.exists(CHROMIUM) and shutil.which("chromium") is None:
        return "chromium is not installed (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    reason = chromium_missing()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        executable = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
