"""`make test`: every test, in two pytest sessions side by side, one per core of a 2-core machine.

The suite is CPU-bound but a single session keeps about one core busy (most of its time is one
engine process at a time); two sessions over disjoint halves of the tree finish in a bit more
than half the time. Each session is bound to its own share of the cores (its CPU affinity, which
its engines read to size their torch threads, engine/config.py `cpu_threads_per_process`): two
sessions sharing every core would each run torch's spinning threads against the other's, which
made some tests ten times slower. pytest-xdist was tried and dropped: workers died mid-run.

Each half is a set of folders and files (`HALVES`), kept whole where tests share a session
fixture (the traced runs of tests/conftest.py are used by tests/traces and tests/viz, so both sit
in one half and each run is recorded once). The halves were balanced by measured time; when one
grows past the other, move a folder. A test file in neither half is an error, so nothing is
skipped silently.

Each session writes its own log; both are printed when they end, then the exit status is the
worse of the two. Extra arguments go to both sessions (`-m "not slow"`, `-x`, `-k ...`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from subprocess import STDOUT

ROOT = Path(__file__).resolve().parent.parent
# Measured on 2 cores (2026-12-05): the engine's process-starting tests are about three quarters
# of the suite, so half of them run beside everything else.
HALVES = {
    "engine": [
        "tests/engine/entrypoints",
        "tests/engine/bench",
        "tests/engine/executor",
        "tests/engine/test_stopping.py",
        "tests/engine/test_process_lifetime.py",
        "tests/engine/test_engine_processes.py",
        "tests/engine/test_data_parallel.py",
    ],
    "rest": [
        "tests/engine",
        "tests/traces",
        "tests/viz",
        "tests/tutorials",
        "tests/kernels",
        "tests/tools",
        "tests/site",
        "tests/test_layering.py",
    ],
}


def _arguments(half: str) -> list[str]:
    """The half's paths for pytest; `rest` names tests/engine whole and leaves out what the
    engine half runs."""
    paths = HALVES[half]
    if half == "rest":
        return [*paths, *(f"--ignore={p}" for p in HALVES["engine"])]
    return list(paths)


def _unassigned() -> list[str]:
    """Test files in no half."""
    covered = [ROOT / p for half in HALVES.values() for p in half]
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if not any(path == c or c in path.parents for c in covered):
            found.append(str(path.relative_to(ROOT)))
    return found


def _stop(procs: list[subprocess.Popen]) -> None:
    """Interrupt sessions still running (pytest tears its fixtures down, and with them the
    processes its tests started), then kill what has not ended within a minute."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _cores() -> list[set[int]]:
    """The cores each half is bound to: this process's cores, split in two."""
    cores = sorted(os.sched_getaffinity(0))
    middle = len(cores) // 2
    return [set(cores[:middle]), set(cores[middle:])]


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if len(os.sched_getaffinity(0)) < 2:  # one core: the halves one after the other
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "--durations=25", *argv])
    missing = _unassigned()
    if missing:
        print(f"tools/run_tests.py: in no half of HALVES: {', '.join(missing)}", file=sys.stderr)
        return 2
    logs = ROOT / "build" / "test-logs"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    running = {}
    for half, cores in zip(HALVES, _cores(), strict=True):
        log = (logs / f"{half}.log").open("w")
        cmd = [sys.executable, "-m", "pytest", "-q", "--durations=15", *argv, *_arguments(half)]
        bind = partial(os.sched_setaffinity, 0, cores)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=STDOUT, preexec_fn=bind)
        running[half] = (proc, log)
    print(f"tools/run_tests.py: {len(running)} pytest sessions side by side, logs in {logs}/")
    status = 0
    try:
        for half, (proc, log) in running.items():
            code = proc.wait()
            log.close()
            print(f"\n==== {half} half: pytest exited {code} "
                  f"({time.monotonic() - start:.0f} s since the start) ====")  # fmt: skip
            print((logs / f"{half}.log").read_text(), end="")
            # pytest's 5 means "no tests collected", which a -k or -m filter can give one half.
            status = max(status, 0 if code == 5 else code)
    finally:
        _stop([proc for proc, _ in running.values()])
    print(f"\ntools/run_tests.py: both halves done in {time.monotonic() - start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
