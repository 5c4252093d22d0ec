"""Start a real `stepscope serve` process on loopback for tests, and stop it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from stepscope.engine.entrypoints.serve import ServerProcess
from stepscope.traces.process import free_port
from tests.process_tree import ProcessTree

__all__ = ["API_KEY", "CLI", "SERVED_MODEL", "Server", "free_port", "served"]

# `stepscope ...` as a command line that runs this checkout's code in this interpreter.
CLI = [sys.executable, "-m", "stepscope.engine.entrypoints.cli"]

# The shared server's (tests/engine/conftest.py): its model, and the key it requires.
SERVED_MODEL = "tiny-llama"
API_KEY = "sk-test-key"


class Server(ServerProcess):
    """`ServerProcess` with a shorter start-up limit and a /metrics reader."""

    def __init__(self, *args: str, timeout: float = 120.0) -> None:
        super().__init__(*args, timeout=timeout)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@contextmanager
def served(*args: str, timeout: float = 120.0) -> Iterator[Server]:
    """`stepscope serve ARGS` for the block's length: stopped after it, and every process it
    started killed, a start that failed halfway included."""
    tree = ProcessTree()
    try:
        with tree.adopting():
            server = Server(*args, timeout=timeout)
        try:
            yield server
        finally:
            server.stop()
    finally:
        tree.kill()
