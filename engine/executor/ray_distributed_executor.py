"""The Ray executor (`--distributed-executor-backend ray`): one Ray actor per tensor-parallel rank,
in place of a worker process (vLLM: `RayDistributedExecutor` in vllm/v1/executor/ray_executor.py).

Only the start differs from `MultiprocExecutor`, whose channels, step path and failure handling
this executor keeps: each actor runs the worker process's main (engine/worker/worker_proc.py),
which subscribes to the engine core's step broadcast and answers on its reply socket, and the
ranks all-reduce over torch.distributed (gloo) as worker processes do. So a step costs what it
costs with mp. vLLM sends each step through Ray instead (a compiled graph); here Ray places,
starts, watches and stops the workers, and the step path stays the one the trace shows.

Placement: the workers share the engine core's machine (its sockets are ipc paths there, and
torch.distributed rendezvouses on it), each in a bundle of the rank's placement group when the
engine core is itself an actor (`--data-parallel-backend ray`), else in a placement group of this
executor's own, pinned to this node. A worker actor that dies is seen through its sentinel like a
worker process's (`ray_utils.ActorProcess`); one that ends with the engine core is removed by
Ray, which stops the actors of an owner that is gone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from stepscope.engine.config import Endpoints, EngineConfig
from stepscope.engine.executor import ray_utils
from stepscope.engine.executor.multiproc_executor import MultiprocExecutor
from stepscope.engine.worker.worker_proc import _worker_main


class RayDistributedExecutor(MultiprocExecutor):
    def _start_workers(self, config: EngineConfig, model_dir: Path, endpoints: Endpoints) -> None:
        ray_utils.connect(endpoints.ray_address)
        p = config.parallel_config
        threads = p.cpu_threads_per_process
        group = ray_utils.current_placement_group()
        want = {"CPU": float(threads)}
        self._own_group = None
        if group is None:  # a group of our own, on this node: a bundle per worker
            bundle = {**want, f"node:{ray_utils.node_ip()}": 0.001}
            group = self._own_group = ray_utils.placement_group(
                [bundle] * self.world_size, "stepscope-workers"
            )
            want = bundle
        try:
            actors = ray_utils.start_actors(
                [
                    ray_utils.ActorSpec(f"stepscope-worker-{rank}", [], want, group, rank)
                    for rank in self.local_ranks
                ]
            )
        except BaseException:
            self._release_group()
            raise
        config = config.replace(parallel_config=msgspec.structs.replace(p, cpu_threads=threads))
        config_bytes = msgspec.msgpack.encode((config, endpoints))
        for rank, actor in zip(self.local_ranks, actors, strict=True):
            actor.run(
                _worker_main,
                config_bytes,
                str(model_dir),
                rank,
                self.world_size,
                self.addresses,
                self._group.tmp_dir if rank == 0 else None,
                None,  # Ray stops the actors of an engine core that is gone
                sys.exit,  # the actor returns its exit code instead of ending its process
            )
        self._group.procs.extend(actors)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        super().shutdown()
        self._release_group()

    def _release_group(self) -> None:
        if self._own_group is not None:
            ray_utils.remove_groups([self._own_group])
            self._own_group = None
