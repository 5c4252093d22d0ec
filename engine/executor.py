"""Executors: how the engine core reaches its workers (stage 5, core -> worker -> core).

`UniProcExecutor` runs the one worker inside the engine-core process, as vLLM does for a single
device: the SchedulerOutput still crosses a (function-call) boundary as the same message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from stepscope.engine.config import EngineConfig
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput
from stepscope.traces.setup import flush_tracing


class Executor(ABC):
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

    def flush_traces(self) -> None:
        """Export the spans the workers have ended so far."""
        flush_tracing()


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        from stepscope.engine.worker import Worker

        self.worker = Worker(config, model_dir, rank=0, world_size=1)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
