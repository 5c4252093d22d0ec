"""A worker: owns one device's memory, the model shard and its KV cache (stage 6).

Sets up the device and threads, then hands each step to its ModelRunner.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stepscope.engine.config import EngineConfig
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput
from stepscope.engine.model_runner import ModelRunner


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        rank: int = 0,
        world_size: int = 1,
        all_reduce=None,
    ) -> None:
        self.rank = rank
        if config.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(config.device))
        self.model_runner = ModelRunner(config, model_dir, rank, world_size, all_reduce)

    def determine_num_kv_blocks(self) -> int:
        return self.model_runner.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
