"""The executor interface: how the engine core reaches its workers (core -> worker -> core).

Two implementations: `UniProcExecutor` (uniproc_executor.py) and `MultiprocExecutor`
(multiproc_executor.py).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from stepscope.engine.config import EngineConfig
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput
from stepscope.traces import crossing
from stepscope.traces.crossing import traced_receive
from stepscope.traces.setup import flush_tracing


class Executor(ABC):
    # The last step's core -> worker -> core time, less the worker's own execute: what crossing
    # the process boundary costs. None when the worker runs in this process (no crossing).
    last_crossing_seconds: float | None = None

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """Blocks the KV pool can hold on every worker."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV pool on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; one rank's output comes back."""

    def shutdown(self) -> None:  # noqa: B027 - an in-process worker has nothing to stop
        """Stop the workers."""

    def processes(self) -> list[tuple[str, int, int]]:
        """(role, rank, pid) of each worker process this executor started."""
        return []

    def check_health(self) -> None:  # noqa: B027 - an in-process worker cannot die apart
        """Raise RuntimeError if a worker is gone; called by the idle busy loop, never blocks."""

    @abstractmethod
    def worker_configs(self) -> list[EngineConfig]:
        """Each worker rank's configuration, as it arrived in its process."""

    def receive_output(
        self, decode, payload: bytes, step: int, sent_at: float, worker_seconds: float
    ) -> ModelRunnerOutput:
        """Rank 0's step output, crossing back from its worker (a traced receive); the step's
        crossing time is what passed since `sent_at` less the worker's own `worker_seconds`."""
        output = traced_receive(crossing.WORKER_TO_ENGINE_CORE, decode, payload, step=step)
        self.last_crossing_seconds = time.perf_counter() - sent_at - worker_seconds
        return output

    def flush_traces(self) -> None:
        """Export the spans the workers have ended so far."""
        flush_tracing()
