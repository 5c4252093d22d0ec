"""What every stepscope process needs of its neighbours: to die with the process that started it,
and a free port to listen on. It lives at the bottom of the import layers (it imports nothing of
stepscope), so that the engine, the trace collector and the dashboard all use this one copy.

Every process stepscope starts dies with the process that started it.

A parent that ends cleanly (Ctrl-C, SIGTERM) stops its children itself; one that is killed
(SIGKILL, a crash) cannot. So each child process runs `watch_parent`: a daemon thread that
notices, within `poll_s`, that its parent is gone (the child was re-parented) and then ends the
child the way that child ends cleanly.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable

POLL_S = 0.5
# `stepscope serve` started by another stepscope process (the demo, `bench serve`) is told
# whom to watch through the environment: its command line stays the one a user would type.
PARENT_ENV = "STEPSCOPE_PARENT_PID"


def terminate_self() -> None:
    """SIGTERM to this process: it unwinds as if a process manager had stopped it."""
    os.kill(os.getpid(), signal.SIGTERM)


def watch_parent(
    parent_pid: int, on_parent_death: Callable[[], None] = terminate_self, poll_s: float = POLL_S
) -> threading.Thread:
    """Call `on_parent_death` once `parent_pid` is no longer this process's parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        on_parent_death()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def watch_parent_from_env() -> None:
    """Watch the parent named in $STEPSCOPE_PARENT_PID, if any (not passed on to children)."""
    pid = os.environ.pop(PARENT_ENV, None)
    if pid:
        watch_parent(int(pid))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
