"""`UniProcExecutor` runs the one worker inside the engine-core process, as vLLM does for a single
device: the SchedulerOutput still crosses a (function-call) boundary as the same message."""

from __future__ import annotations

from pathlib import Path

from stepscope.engine.config import EngineConfig
from stepscope.engine.executor.abstract import Executor
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        from stepscope.engine.worker.worker import Worker

        self.worker = Worker(config, model_dir, rank=0, world_size=1)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def worker_configs(self) -> list[EngineConfig]:
        return [self.worker.get_config()]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
