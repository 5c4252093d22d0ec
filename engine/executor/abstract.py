"""The executor interface: how the engine core reaches its workers (core -> worker -> core).

Two implementations: `UniProcExecutor` (uniproc_executor.py) and `MultiprocExecutor`
(multiproc_executor.py). Both run steps in the order they were sent, which async scheduling
relies on: a step sent before the last one's output is back finds that output's tokens in the
worker (vLLM: `Executor.execute_model(..., non_block=True)`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future

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
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on every worker; one rank's output comes back. `non_block`: return at
        once with the output's Future, the step running after the steps sent before it."""

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
        self, decode, payload: bytes, step: int, sent_at: float | None, worker_seconds: float
    ) -> ModelRunnerOutput:
        """Rank 0's step output, crossing back from its worker (a traced receive); the step's
        crossing time is what passed since `sent_at` less the worker's own `worker_seconds`.
        No `sent_at` (a step sent while another ran, whose output may wait to be read): the
        crossing cannot be told from the waiting, and is not measured."""
        output = traced_receive(crossing.WORKER_TO_ENGINE_CORE, decode, payload, step=step)
        self.last_crossing_seconds = (
            None if sent_at is None else time.perf_counter() - sent_at - worker_seconds
        )
        return output

    def flush_traces(self) -> None:
        """Export the spans the workers have ended so far."""
        flush_tracing()
