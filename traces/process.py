"""What every stepscope process needs of its neighbours: to die with the process that started it,
and a free port to listen on. It lives at the bottom of the import layers (it imports nothing of
stepscope), so that the engine, the trace collector and the dashboard all use this one copy.

Every process stepscope starts dies with the process that started it.

A parent that ends cleanly (Ctrl-C, SIGTERM) stops its children itself; one that is killed
(SIGKILL, a crash) cannot. So each child process runs `watch_parent`: a daemon thread that
notices, within `poll_s`, that its parent is gone (the child was re-parented) and then ends the
child the way that child ends cleanly.

A terminal's Ctrl-C (SIGINT) and hang-up (SIGHUP) reach every process of its foreground process
group at once, children included. A child that died of them would take its unsent spans with it,
and the trace collector would close the file while the others still export. So every child
ignores both (`ignore_terminal_signals`): its parent, which gets them too, stops the children in
order and the collector last.
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


def ignore_terminal_signals() -> None:
    """SIGINT and SIGHUP are the parent's to handle (the terminal sends them to the whole group)."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def exit_once_on(*signums: int) -> None:
    """The first of `signums` raises SystemExit(0) in the main thread; later ones are ignored,
    so the unwinding it starts (stopping children, flushing spans) runs to its end. A group's
    SIGTERM and the parent's own SIGTERM often both arrive."""

    def handler(signum: int, frame: object) -> None:
        for other in signums:
            signal.signal(other, signal.SIG_IGN)
        raise SystemExit(0)

    for signum in signums:
        signal.signal(signum, handler)


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
