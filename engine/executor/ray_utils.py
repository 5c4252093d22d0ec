"""Ray as a launcher: the cluster, placement groups, and stepscope processes run as Ray actors.
Mirrors vLLM's vllm/v1/executor/ray_utils.py (the cluster, placement groups) and
`CoreEngineActorManager` in vllm/v1/engine/utils.py (DP engine cores as actors).

Ray places, starts, watches and stops processes; it does not carry the request path. An engine
core that runs as an actor takes requests over the same ZMQ sockets as an engine-core process,
and its workers (also actors, with `--distributed-executor-backend ray`) take steps over the
same sockets as worker processes, so a step costs the same on either backend. What changes is
who starts the process and where it lands:

- `connect`: join the cluster at $RAY_ADDRESS (KubeRay, `ray start --head`), or start a local one
  for this run. Ray stops a local cluster when the process that started it exits (its own atexit
  hook), also when a script never calls shutdown.
- `start_actors`: a `_ProcessActor` each in a bundle of a placement group, running one process's
  main function (`run_engine_core`, a worker's main) in its main thread, so that it installs its
  signal handlers as a process of its own does. `where()` answers first (pid, node), then the
  long `run()` call doubles as the liveness handle (vLLM's `run.remote()`): it returns the
  process's exit code, or raises once the actor is gone.
- `ActorProcess`: that actor held as the launcher holds a process: `poll`, `wait`,
  `terminate`, `kill` and `pid` as `subprocess.Popen` has them, `exitcode`, `join` and a
  `sentinel` file descriptor as `multiprocessing.Process` has them. So the start-up handshake,
  the liveness watchers and the stopping code are the ones the process backends use. Once its
  run ends the actor is killed and its placement group removed.

Threads: Ray starts workers with OMP_NUM_THREADS=1. A process placed by Ray runs with its bundle's
CPUs as torch threads (`ParallelConfig.cpu_threads`), which the C kernels follow too.
Signals: an actor runs in a process group of its own, so a terminal's Ctrl-C reaches only the
launcher, which stops the actors in order, as it stops its child processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from stepscope.engine.config import require_ray

# Placing an actor waits for its placement group: on a cluster without room for it, the
# message says what was asked for instead of waiting forever.
PLACEMENT_TIMEOUT_S = 120.0


def connect(address: str | None = None, num_cpus: int | None = None) -> str:
    """Join the cluster at `address` (else $RAY_ADDRESS), or start a local one for this run; its
    address, which the processes this one starts join.

    A local cluster counts `num_cpus` CPUs where that is more than this machine's cores: the
    process backends run more compute processes than cores when asked to (DP x TP on a small
    machine, each with a share of the cores), and the ray backends place the same processes."""
    require_ray()
    import ray

    global _init_ns
    if not ray.is_initialized():
        started_ns = time.time_ns()
        address = address or os.environ.get("RAY_ADDRESS")
        local = None if address else max(num_cpus or 0, os.cpu_count() or 1)
        with _signals_kept():
            ray.init(
                # "local": a new cluster, even where `ray start` left one on this machine
                address=address or "local",
                num_cpus=local,
                include_dashboard=False,
                log_to_driver=True,  # an actor's traceback is printed here, as a child's would be
                logging_level="warning",
            )
        _init_ns = (started_ns, time.time_ns())
    return ray.get_runtime_context().gcs_address


# When this process last joined or started a cluster (wall-clock ns), until a trace takes it.
_init_ns: tuple[int, int] | None = None


def take_connect_times() -> tuple[int, int] | None:
    """The start and end of this process's `ray.init`, once (None after, or if never called):
    the engine start's span reaches back to it, as the run waited for it."""
    global _init_ns
    times, _init_ns = _init_ns, None
    return times


def connect_for(config: Any, address: str | None = None) -> str:
    """`connect`, counting for a local cluster the CPUs `config`'s compute processes take."""
    p = config.parallel_config
    processes = p.data_parallel_size * p.tensor_parallel_size
    return connect(address, num_cpus=processes * p.cpu_threads_per_process)


def output_address(folder: str) -> str:
    """Where an API server on this machine takes its outputs: an ipc path in `folder`, or a TCP
    port on this node's address when the cluster's nodes are on several hosts (an engine core
    may land on another)."""
    if spans_hosts():
        from stepscope.traces.process import free_port

        host = node_ip()
        return f"tcp://{host}:{free_port(host)}"
    return f"ipc://{folder}/out"


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """Start a local cluster with this process's signal handling kept.

    Its processes (GCS, raylet) start in this process group, and a terminal's Ctrl-C or hang-up,
    or a process manager's SIGTERM to the group, must reach the launcher only, which stops the
    actors in order and the cluster last (a GCS killed by SIGHUP first leaves the driver waiting
    a minute for it, then aborting, its spans unsent). So the three are blocked while it starts:
    its processes inherit the mask and never receive them; here they wait, pending, until the
    block lifts. And `ray.init` installs SIGTERM handlers of its own in this process (one exits
    on the spot, skipping the unwinding that stops the engine and saves the trace): the ones
    this process had are put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = {signal.SIGINT, signal.SIGHUP, signal.SIGTERM}
    handlers = {signum: signal.getsignal(signum) for signum in signums}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def spans_hosts() -> bool:
    """Whether the cluster's nodes are on more than one host (a fake `Cluster` is on one)."""
    import ray

    return len({node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}) > 1


def node_ip() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


class _ProcessActor:
    """One stepscope process inside a Ray worker process (made remote by `_actor_class`)."""

    def where(self) -> tuple[int, str, str]:
        import ray

        ctx = ray.get_runtime_context()
        return os.getpid(), ctx.get_node_id(), node_ip()

    def run(self, main: Callable[..., Any], *args: Any) -> int:
        """Run `main(*args)` to its end in this (main) thread; its exit code."""
        signums = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        ray_handlers = {signum: signal.getsignal(signum) for signum in signums}
        try:
            main(*args)
        except SystemExit as e:  # SIGTERM's unwinding, or a worker's exit
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            # Ray's own handlers again, for the kill that releases this actor.
            for signum, handler in ray_handlers.items():
                signal.signal(signum, handler)
        return 0


class ActorSpec(NamedTuple):
    """One actor to start: its name, and where it goes: bundle `bundle_index` of
    `placement_group`, or of a new group of `bundles` placed with `strategy`; it takes
    `resources` of that bundle (default: all of it)."""

    name: str
    bundles: list[dict[str, float]]
    resources: dict[str, float] | None = None
    placement_group: Any = None
    bundle_index: int = 0
    strategy: str = "STRICT_PACK"
    node_id: str | None = None  # a new group goes there if it fits there, else anywhere


def start_actors(specs: list[ActorSpec]) -> list[ActorProcess]:
    """Place and start every actor of `specs`, all at once; returns once each has answered
    where it runs. Nothing runs in them yet (`ActorProcess.run`). On a failure nothing is left."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = time.perf_counter()
    groups = [
        (spec.placement_group, False)
        if spec.placement_group is not None
        else (placement_group(spec.bundles, spec.name, spec.strategy, spec.node_id), True)
        for spec in specs
    ]
    actors: list[Any] = []
    try:
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        for spec, (group, _) in zip(specs, groups, strict=True):
            if not group.wait(max(deadline - time.monotonic(), 0.0)):
                raise RuntimeError(
                    f"Ray could not place {spec.name} ({spec.bundles}, {spec.strategy}) within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()} "
                    "free"
                )
        placed = time.perf_counter()
        for spec, (group, _) in zip(specs, groups, strict=True):
            want = dict(spec.resources if spec.resources is not None
                        else spec.bundles[spec.bundle_index])  # fmt: skip
            actors.append(
                _actor_class()
                .options(
                    num_cpus=want.pop("CPU", 0),
                    num_gpus=want.pop("GPU", 0),
                    resources=want or None,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group,
                        placement_group_bundle_index=spec.bundle_index,
                        placement_group_capture_child_tasks=True,
                    ),
                )
                .remote()
            )
        wheres = ray.get([actor.where.remote() for actor in actors])
    except BaseException:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        remove_groups([group for group, ours in groups if ours])
        raise
    up = time.perf_counter()
    return [
        ActorProcess(
            spec.name, actor, group if ours else None, where, placed - started, up - placed
        )  # fmt: skip
        for spec, actor, (group, ours), where in zip(specs, actors, groups, wheres, strict=True)
    ]


@functools.cache
def _actor_class() -> Any:
    import ray

    return ray.remote(_ProcessActor)


def placement_group(
    bundles: list[dict[str, float]],
    name: str,
    strategy: str = "STRICT_PACK",
    node_id: str | None = None,
) -> Any:
    """A placement group for actors that `start_actors` places in it (on node `node_id` where
    it fits); the caller removes it."""
    from ray.util.placement_group import placement_group as make

    return make(bundles, strategy=strategy, name=name, _soft_target_node_id=node_id)


def nodes_for(cpus: float) -> list[str]:
    """The alive nodes with at least `cpus` CPUs, this process's node first: where the DP ranks
    go in turn, one per node before a second on any (vLLM spreads its DP ranks alike)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [
        node["NodeID"]
        for node in ray.nodes()
        if node["Alive"] and node["Resources"].get("CPU", 0) >= cpus
    ]
    return sorted(nodes, key=lambda node: node != here)


def remove_groups(groups: list[Any]) -> None:
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)


class ActorProcess:
    """A running `_ProcessActor`, held like a process (see the module docstring). An actor that
    died without returning (killed, crashed, its node lost) reads as killed by SIGKILL: Ray does
    not say by which signal; `death` holds what Ray said."""

    def __init__(
        self,
        name: str,
        actor: Any,
        placement_group: Any,
        where: tuple[int, str, str],
        placement_s: float,
        actor_start_s: float,
    ) -> None:
        self.name = name
        self.pid, self.node_id, self.node_ip = where
        self.placement_s = placement_s  # waiting for the placement groups
        self.actor_start_s = actor_start_s  # the actors' processes started and answered
        self.death: str | None = None
        self._actor = actor
        self._group = placement_group  # ours to remove, or None
        self._ref: Any = None
        self._code: int | None = None
        self._lock = threading.Lock()
        self.sentinel, self._sentinel_w = os.pipe()

    def run(self, main: Callable[..., Any], *args: Any) -> None:
        """Start `main(*args)` in the actor; it runs until it returns or the actor dies."""
        self._ref = self._actor.run.remote(main, *args)
        threading.Thread(target=self._watch, name=f"watch-{self.name}", daemon=True).start()

    def _watch(self) -> None:
        """Make `sentinel` readable once the run has ended, however it ended."""
        import ray

        with contextlib.suppress(Exception):  # Ray shut down: the actor is gone too
            ray.wait([self._ref], timeout=None, fetch_local=False)
        os.close(self._sentinel_w)

    # ---- subprocess.Popen --------------------------------------------------------------------
    def poll(self) -> int | None:
        if self._code is not None or self._ref is None:
            return self._code
        import ray

        try:
            ready, _ = ray.wait([self._ref], timeout=0, fetch_local=False)
        except Exception as e:  # Ray itself is gone
            return self._ended(-signal.SIGKILL, f"Ray shut down: {e}")
        if not ready:
            return None
        try:
            code = ray.get(self._ref)
        except ray.exceptions.RayActorError as e:
            return self._ended(-signal.SIGKILL, str(e).splitlines()[0])
        except ray.exceptions.RayTaskError as e:
            return self._ended(1, str(e).splitlines()[0])
        return self._ended(int(code), None)

    def _ended(self, code: int, death: str | None) -> int:
        with self._lock:
            if self._code is None:
                self._code, self.death = code, death
                self.release()
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        import ray

        if self._ref is None:  # never ran: nothing to wait for
            os.close(self._sentinel_w)
            return self._ended(0, None)

        try:
            ready, _ = ray.wait([self._ref], timeout=timeout, fetch_local=False)
        except Exception:
            ready = [self._ref]  # Ray is gone, and the actor with it
        if not ready:
            raise subprocess.TimeoutExpired(self.name, timeout or 0)
        code = self.poll()
        assert code is not None
        return code

    def terminate(self) -> None:
        """SIGTERM, as to a process: it stops cleanly and flushes its spans. An actor on another
        machine cannot be signalled from here and is killed instead."""
        if self._code is not None:
            return
        if self.node_ip == _this_node_ip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
        else:
            self.kill()

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)
        self.wait(10)

    # ---- multiprocessing.Process -------------------------------------------------------------
    @property
    def exitcode(self) -> int | None:
        return self.poll()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout)

    def is_alive(self) -> bool:
        return self.poll() is None

    # ---- Ray ---------------------------------------------------------------------------------
    def release(self) -> None:
        """Kill the actor (its run has ended) and remove its placement group."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)
        if self._group is not None:
            remove_groups([self._group])
            self._group = None


def _this_node_ip() -> str:
    try:
        return node_ip()
    except Exception:
        return ""


def current_placement_group() -> Any:
    """The placement group this process's actor runs in, or None outside one."""
    import ray.util

    return ray.util.get_current_placement_group()
