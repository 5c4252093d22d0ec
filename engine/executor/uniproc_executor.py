"""`UniProcExecutor` runs the one worker inside the engine-core process, as vLLM does for a single
device: the SchedulerOutput still crosses a (function-call) boundary as the same message.

A step sent with `non_block` (async scheduling) runs on the executor's one worker thread, so the
engine core's thread schedules the next step and updates from the last one meanwhile. The
forward runs mostly outside the GIL (torch ops and the ctypes C kernels release it); one thread
runs the steps one after another, in the order sent, as a worker process does.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from stepscope.engine.config import EngineConfig
from stepscope.engine.executor.abstract import Executor
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        from stepscope.engine.worker.worker import Worker

        self.worker = Worker(config, model_dir, rank=0, world_size=1)
        # Its thread starts with the first step sent with non_block.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker")

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def worker_configs(self) -> list[EngineConfig]:
        return [self.worker.get_config()]

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if not non_block:
            return self.worker.execute_model(scheduler_output)
        # The caller's context goes along: the worker's step span is a child of its execute span.
        run = contextvars.copy_context().run
        return self._thread.submit(run, self.worker.execute_model, scheduler_output)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)  # a step still running ends first
