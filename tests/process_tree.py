"""Processes a test starts, and everything they start in turn, killed when the test ends.

Each process started through `ProcessTree` carries a mark in its environment, which every
descendant inherits (stepscope passes its environment on to the engine core, the workers, the
collector and the servers it starts). Teardown kills every process with the mark, wherever it
has been re-parented and whatever session it started: a test that fails or times out halfway
leaves nothing spinning behind it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

MARK = "STEPSCOPE_TEST_TREE"

# Slack on top of a death-detection bound derived from engine/liveness.py: the scheduling delays
# of a loaded machine (two cores, twice as slow as ours, the rest of `make test` beside it), never
# a missed interval.
DETECTION_GRACE_S = 4.0


def noticed_within(*waits: float) -> float:
    """How long a test gives stepscope to notice a death: the intervals and timeouts of
    engine/liveness.py that lie on the way from the death to the error, plus DETECTION_GRACE_S.
    A changed constant moves the bound with it."""
    return sum(waits) + DETECTION_GRACE_S


def pid_alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_pids_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Wait until none of `pids` runs; returns those still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def marked(mark: str, prefix: bool = False) -> list[psutil.Process]:
    """Every live process whose environment carries `MARK=mark` (with `prefix`, a mark that
    starts with `mark`), except this one and its ancestors (a test session run inside a marked
    process, e.g. by the GPU check's dry run, must not kill the processes that started it)."""
    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in spared:
            continue
        try:
            found_mark = proc.environ().get(MARK, "")
            hit = found_mark.startswith(mark) if prefix else found_mark == mark
            if hit and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_marked(mark: str, timeout: float = 10.0, prefix: bool = False) -> list[str]:
    """SIGKILL every process with the mark (or, with `prefix`, a mark that starts with it);
    returns what was left running (pid and command)."""
    procs = marked(mark, prefix)
    left = []
    for proc in procs:
        try:
            left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(procs, timeout=timeout)
    return left


def _terminal_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class ProcessTree:
    """Starts processes for one test; `kill()` ends them and all their descendants."""

    def __init__(self) -> None:
        self.mark = uuid.uuid4().hex
        self.procs: list[subprocess.Popen] = []

    def env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        return {**(os.environ if env is None else env), MARK: self.mark}

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        kwargs["env"] = self.env(kwargs.get("env"))
        # Started as from a terminal, however pytest was: a background `make test` ignores
        # SIGINT (and `nohup` SIGHUP), and a child would inherit that and never see the Ctrl-C
        # or hang-up a test sends it.
        kwargs.setdefault("preexec_fn", _terminal_signals)
        proc = subprocess.Popen(cmd, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """`subprocess.run(cmd, capture_output=True, text=True)`, the tree killed on timeout."""
        proc = self.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    @contextmanager
    def adopting(self) -> Iterator[ProcessTree]:
        """Every process started inside the block, by whatever means (an engine's own
        multiprocessing or Popen, a `ServerProcess`), joins this tree: it inherits the tree's
        mark from this process's environment, as do all its descendants."""
        before = os.environ.get(MARK)
        os.environ[MARK] = self.mark
        try:
            yield self
        finally:
            if before is None:
                del os.environ[MARK]
            else:
                os.environ[MARK] = before

    def alive(self) -> list[psutil.Process]:
        return marked(self.mark)

    def wait_gone(self, timeout: float) -> list[psutil.Process]:
        """Wait until no process of the tree is left; returns those still alive."""
        deadline = time.monotonic() + timeout
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def kill(self) -> list[str]:
        left = kill_marked(self.mark)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        return left
