"""A worker: owns one device's memory, the model shard and its KV cache (stage 6).

Sets up the device and threads, then hands each step to its ModelRunner.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import torch

from stepscope.engine.config import EngineConfig
from stepscope.engine.messages import ModelRunnerOutput, SchedulerOutput
from stepscope.engine.worker.model_runner import ModelRunner
from stepscope.traces.setup import flush_tracing
from stepscope.traces.spans import worker_step_span


def keep_freed_memory() -> None:
    """Make glibc keep freed activation memory instead of returning it to the OS.

    A step's activations are tens of MB; by default glibc serves such blocks with mmap and gives
    them back on free, so every layer of every step pays page faults to zero fresh pages again.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 31)


def cpu_threads() -> int:
    """torch's intra-op threads, capped by the cores this process may run on (all of them where
    the OS cannot say, as macOS)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores))


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
        device = config.model_config.device
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        else:
            keep_freed_memory()
        self.model_runner = ModelRunner(config, model_dir, rank, world_size, all_reduce)
        # On a CPU, the threads a step's forward can run on at once: its CPU time beside its wall
        # time times these tells a busy machine from a slow step (a GPU's steps wait on the GPU).
        self.num_threads = cpu_threads() if not device.startswith("cuda") else None

    def determine_num_kv_blocks(self) -> int:
        return self.model_runner.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.init_kv_cache(num_blocks)

    def get_config(self) -> EngineConfig:
        """The configuration this worker runs with (as it arrived in its process)."""
        return self.model_runner.config

    def flush_traces(self) -> bool:
        return flush_tracing()

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        send_output: Callable[[ModelRunnerOutput], object] | None = None,
    ) -> ModelRunnerOutput:
        """One step, in its `stepscope.worker_step` span. `send_output` (a worker process's reply
        to the engine core) hands the output on inside that span, so the reply is the step's."""
        with worker_step_span(
            scheduler_output.step, self.rank, scheduler_output.trace_context, self.num_threads
        ):
            output = self.model_runner.execute_model(scheduler_output)
            if send_output is not None:
                send_output(output)
            return output
