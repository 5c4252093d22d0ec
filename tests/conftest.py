"""Shared test set-up. Triton decides between compiling and interpreting when a kernel is
defined, so the interpreter is switched on here, before any test module imports a kernel.

The session fixtures below are what several test modules read: each real traced run is recorded
once per session (tests/traced_runs.py says what each run does), and one Chromium serves every
browser test. A fixture that starts processes kills their whole tree when it ends or fails."""

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.process_tree import MARK, ProcessTree, kill_marked
from tests.traced_runs import (
    TracedRun,
    record_dp2_trace,
    record_offline_trace,
    record_tp2_trace,
)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Every process this test session starts carries this mark; whatever is left at the end is
# killed (and named), so that no engine keeps spinning after `make test`.
os.environ.setdefault(MARK, f"session-{uuid.uuid4().hex}")

# `make test` runs the suite in two pytest-xdist workers, one per core (most tests keep about
# one core busy: the engine's processes take turns). A worker marks what it starts with the
# session's mark and its own name, so that its teardown kills only its own processes and the
# controller's (which starts none) kills whatever any worker left; the worker processes keep
# the session's mark and are spared. Each worker is bound to a core of its own, and with it
# every process it starts: an engine sizes its torch threads by the cores it may use, and two
# workers' engines with a thread per core each would fight over both.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ[MARK] = f"{os.environ[MARK]}-{XDIST_WORKER}"
    _cores = sorted(os.sched_getaffinity(0))
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    # The cores dealt out: gw0 gets 0, 2, 4..., gw1 1, 3, 5...
    _mine = _cores[int(XDIST_WORKER.removeprefix("gw")) :: _workers]
    if len(_cores) >= _workers > 1:
        os.sched_setaffinity(0, set(_mine))
        torch.set_num_threads(len(_mine))

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture
def process_tree() -> Iterator[ProcessTree]:
    """Start a test's processes through this; all of them and their descendants die with it."""
    tree = ProcessTree()
    try:
        yield tree
    finally:
        tree.kill()


def _record_in_tree(record, path: Path):
    """`record(path)` with every process it starts in one tree, killed when it returns or
    fails (an engine that hangs in its shutdown included)."""
    tree = ProcessTree()
    try:
        with tree.adopting():
            return record(path)
    finally:
        tree.kill()


@pytest.fixture(scope="session")
def traced_tp2_run(tmp_path_factory) -> TracedRun:
    """A real TP=2 run's trace file (tests/traced_runs.py), with the counts read back from it."""
    return _record_in_tree(record_tp2_trace, tmp_path_factory.mktemp("tp2") / "run.duckdb")


@pytest.fixture(scope="session")
def traced_dp2_run(tmp_path_factory) -> str:
    """A real DP=2 run's trace file (tests/traced_runs.py)."""
    return _record_in_tree(record_dp2_trace, tmp_path_factory.mktemp("dp2") / "dp2.duckdb")


@pytest.fixture(scope="session")
def traced_offline_run(tmp_path_factory) -> str:
    """A real offline run's trace file, every role in this process (tests/traced_runs.py)."""
    path = tmp_path_factory.mktemp("offline") / "trace.duckdb"
    return _record_in_tree(record_offline_trace, path)


def chromium_missing() -> str | None:
    if not os.path.exists(CHROMIUM) and shutil.which("chromium") is None:
        return "chromium is not installed (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    return None


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Debian's Chromium, headless, driven by Playwright (`playwright install` is not needed).
    Its tests run last (see `pytest_collection_modifyitems`)."""
    reason = chromium_missing()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    executable = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    tree = ProcessTree()
    try:
        # Playwright's driver starts Chromium with its own environment: both carry the mark.
        with tree.adopting():
            playwright = sync_playwright().start()
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
            yield browser
            browser.close()
        finally:
            playwright.stop()
    finally:
        tree.kill()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that drive the browser run last, in collection order. While Playwright's sync
    API is open, this thread holds a running event loop and `asyncio.run` refuses to start, so
    the one session browser must not be open while any other test runs."""
    browsing = {item.module for item in items if "browser" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: getattr(item, "module", None) in browsing)  # stable: order kept


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A worker kills its own processes; the xdist controller those of every worker.
    controller = not XDIST_WORKER and session.config.getoption("numprocesses", None)
    left = kill_marked(
        f"{os.environ[MARK]}-" if controller else os.environ[MARK], prefix=bool(controller)
    )
    if left:
        print(f"\nkilled {len(left)} processes the tests left running:", *left, sep="\n  ")
