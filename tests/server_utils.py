"""Start a real `stepscope serve` process on loopback for tests, and stop it."""

from __future__ import annotations

import httpx

from stepscope.engine.multiproc_executor import free_port
from stepscope.engine.serve import ServerProcess

__all__ = ["Server", "free_port"]


class Server(ServerProcess):
    """`ServerProcess` with a shorter start-up limit and a /metrics reader."""

    def __init__(self, *args: str, timeout: float = 120.0) -> None:
        super().__init__(*args, timeout=timeout)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)
