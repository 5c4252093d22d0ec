"""The collector as its parent sees it: start it in a fresh process, tell it to close the file,
and read the run's span counts from its last line (collector.py is the process itself).

`stepscope serve`, the launcher and an offline `LLM` with worker processes each start one
(`start_collector_process`) and stop it last (`stop_collector_process`), once every other process
has flushed its spans: it ignores the signals a terminal or a process manager sends the whole
process group, and closes the file when its stdin is closed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0  # a parent waits this long for the collector to close the file


class CollectorProcess:
    """The collector as a child process: a fresh interpreter (`python -m
    stepscope.traces.backend.collector`), so no caller needs a `__main__` guard, with the small
    part of multiprocessing's Process interface that callers use. `close_file()` tells it to
    flush and close the file (it ignores the signals that `terminate()` would send)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid
        # If the caller forgets to stop it, stop it (flushing the file) at interpreter exit.
        self._finalizer = weakref.finalize(self, _close_and_wait, popen)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def close_file(self) -> None:
        """Ask the collector to insert what it holds, close the file and exit."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        if self.popen.poll() is not None and self.popen.stdout is not None:
            self.popen.stdout.close()


def _close_and_wait(popen: subprocess.Popen) -> None:
    if popen.stdin is not None:
        with contextlib.suppress(OSError):
            popen.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(CLOSE_TIMEOUT_S)


def start_collector_process(
    db_path: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    extensions: Sequence[str] = (),
    timeout_s: float = 60.0,
) -> tuple[CollectorProcess, str]:
    """Start the collector in a fresh process; returns it and its base URL once it listens."""
    cmd = [sys.executable, "-m", "stepscope.traces.backend.collector", str(db_path), "--host", host]
    cmd += ["--port", str(port), "--announce", "--parent-pid", str(os.getpid())]
    for spec in extensions:
        cmd += ["--extension", spec]
    # Its stdin is how we tell it to close the file (and how it learns that we died).
    popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    process = CollectorProcess(popen)
    assert popen.stdout is not None
    ready = selectors.DefaultSelector()
    ready.register(popen.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while True:
        if ready.select(timeout=0.2):
            line = popen.stdout.readline()
            if line.startswith("ready "):
                return process, line.split(None, 1)[1].strip()
            if line.startswith("error "):
                process.join(10)
                raise RuntimeError(f"collector failed to start: {line[6:].strip()}")
        if not process.is_alive():
            raise RuntimeError(f"collector exited with code {process.exitcode} before it was ready")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"collector not ready after {timeout_s} s")


def stop_collector_process(
    process: CollectorProcess, timeout_s: float = CLOSE_TIMEOUT_S
) -> dict[str, Any] | None:
    """Tell the collector to close its file and wait until it has (at most `timeout_s`): the
    next line of the caller can open the file. Returns the run's counts (`Collector.summary`),
    or None when the collector could not say (it died, or was killed after `timeout_s`)."""
    process.close_file()
    summary = None
    stdout = process.popen.stdout
    deadline = time.monotonic() + timeout_s
    if stdout is not None and not stdout.closed:
        ready = selectors.DefaultSelector()
        ready.register(stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not ready.select(timeout=min(left, 0.5)):
                continue
            line = stdout.readline()
            if not line:
                break  # it exited
            if line.startswith("closed "):
                summary = json.loads(line[7:])
        ready.close()
    process.join(max(0.0, deadline - time.monotonic()))
    if process.is_alive():
        print(
            f"stepscope: the trace collector did not close its file within {timeout_s:.0f} s; "
            "killing it (the file may lack its last spans)",
            file=sys.stderr,
            flush=True,
        )
        process.kill()
        process.join()
    return summary


def describe_summary(summary: dict[str, Any] | None) -> str:
    """The run's span counts in one phrase, for a closing line."""
    if summary is None:
        return "span counts unknown (the collector did not report them)"
    text = (
        f"{summary['spans']:,} spans from {summary['processes']} processes, {summary['lost']} lost"
    )
    if summary["lost_by"]:
        text += " (" + ", ".join(f"{who}: {k}" for who, k in summary["lost_by"].items()) + ")"
    if summary["silent"]:
        text += "; sent spans but never reported its counts: " + ", ".join(summary["silent"])
    return text
