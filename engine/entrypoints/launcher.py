"""The launcher process of `stepscope serve`, when one API server holding the engine is not
enough (vLLM: `run_multi_api_server` with `APIServerProcessManager`, and `run_headless`).

- Several API servers (`--api-server-count A`): this process opens the listening socket, starts
  the engine (`EngineGroup`: the DP coordinator and every local DP rank's engine core), then A
  API-server processes that inherit the socket (the kernel hands each new connection to one of
  them) and attach to every engine core. It serves nothing itself; it watches them and stops
  them all on SIGINT/SIGTERM.
- The head of several machines (`--data-parallel-size-local L` < `--dp N`): the same, and the
  engine group also waits for the ranks that register from other machines over TCP at
  `--data-parallel-address:--data-parallel-rpc-port`.
- A headless machine (`--headless`): only engine cores, for DP ranks R .. R+L-1; they register
  with the head, take requests from its API servers over TCP, send their outputs there, their
  load to its coordinator and their spans to `--otlp-endpoint` (the head's collector). This
  process ends when they do: when the head shuts them down, or when one dies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from stepscope.engine.config import Endpoints, EngineConfig
from stepscope.engine.entrypoints.serving import ServerOptions
from stepscope.engine.frontend.engine_group import (
    Attachment,
    EngineGroup,
    start_core_process,
    stop_process,
)
from stepscope.engine.liveness import LAUNCHER_POLL_S
from stepscope.engine.messages import ProcessInfo
from stepscope.engine.models.loader import resolve_model
from stepscope.traces.process import free_port


class APIServerArgs(msgspec.Struct):
    """What an API-server process started by the launcher reads from its stdin."""

    attach: Attachment  # the engine cores, its client index and where their outputs come in
    fd: int  # the shared listening socket
    options: ServerOptions
    config: EngineConfig
    endpoints: Endpoints
    processes_file: str  # every process of the deployment, as JSON (for GET /processes)
    parent_pid: int


# ---- arguments ----------------------------------------------------------------------------------
def has_remote_ranks(args: argparse.Namespace) -> bool:
    local = args.data_parallel_size_local
    return not args.headless and local is not None and local < args.data_parallel_size


def needs_launcher(args: argparse.Namespace) -> bool:
    return args.api_server_count > 1 or has_remote_ranks(args)


def check_scale_out_args(args: argparse.Namespace) -> None:
    """A clear ValueError for every inconsistent combination, before anything starts."""
    dp, local = args.data_parallel_size, args.data_parallel_size_local
    start = args.data_parallel_start_rank
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.engine_ready_timeout <= 0:
        raise ValueError(
            f"--engine-ready-timeout must be positive, got {args.engine_ready_timeout}"
        )
    if args.data_parallel_backend == "ray" and (
        args.headless or local is not None or args.nnodes > 1
    ):
        raise ValueError(
            "--data-parallel-backend ray places every DP rank on the Ray cluster itself: drop "
            "--headless, --data-parallel-size-local and --nnodes (start more machines with "
            "`ray start --address ...`, and point RAY_ADDRESS at the cluster)"
        )
    if args.nnodes > 1 and dp != 1:
        raise ValueError(
            "--nnodes spreads one engine's TP workers over machines and needs --dp 1; for DP "
            "ranks on other machines use --data-parallel-size-local and --headless"
        )
    if args.headless and args.nnodes > 1:
        if args.node_rank < 1:
            raise ValueError(
                "--headless --nnodes runs the workers of node 1 or later (--node-rank)"
            )
        if args.api_server_count != 1 or args.trace_db or args.dashboard_port is not None:
            raise ValueError(
                "--headless runs no API server and no collector: drop --api-server-count, "
                "--trace-db and --dashboard-port (send spans to the head with --otlp-endpoint)"
            )
        return
    if not args.headless:
        if start != 0:
            raise ValueError("--data-parallel-start-rank is for --headless machines")
        if args.node_rank != 0:
            raise ValueError("--node-rank > 0 is a workers-only machine: add --headless")
        return
    if local is None or local < 1:
        raise ValueError("--headless needs --data-parallel-size-local L >= 1: the ranks it runs")
    if start < 0 or start + local > dp:
        raise ValueError(
            f"--headless: ranks {start}..{start + local - 1} do not fit in --dp {dp} "
            "(--data-parallel-start-rank + --data-parallel-size-local must be <= --dp)"
        )
    if args.api_server_count != 1 or args.trace_db or args.dashboard_port is not None:
        raise ValueError(
            "--headless runs no API server and no collector: drop --api-server-count, "
            "--trace-db and --dashboard-port (send spans to the head with --otlp-endpoint)"
        )


# ---- the head -----------------------------------------------------------------------------------
def launch(args: argparse.Namespace, config: EngineConfig, endpoints: Endpoints, name: str) -> None:
    """Start the engine and A API servers sharing one port; return once they have stopped."""
    model_dir = resolve_model(config.model_config.model)
    dp = config.parallel_config.data_parallel_size
    count = args.api_server_count
    remote = has_remote_ranks(args)
    host = args.data_parallel_address
    if config.parallel_config.data_parallel_backend == "ray":
        from stepscope.engine.executor import ray_utils

        ray_utils.connect_for(config, endpoints.ray_address)
        if ray_utils.spans_hosts():  # an engine core may land on another host
            remote, host = True, ray_utils.node_ip()
    folder = tempfile.mkdtemp(prefix="stepscope-serve-")
    if remote:  # engine cores on other machines must reach the API servers' output sockets
        output_addrs = [f"tcp://{host}:{free_port(host)}" for _ in range(count)]
    else:
        output_addrs = [f"ipc://{folder}/api-{i}" for i in range(count)]
    listener = socket.create_server((args.host, args.port))
    listener.set_inheritable(True)
    # SIGTERM or a hang-up during start-up unwinds like Ctrl-C: the trace is flushed, the
    # processes already started are stopped.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    local = args.data_parallel_size_local
    group = EngineGroup(
        config,
        model_dir,
        endpoints,
        output_addrs,
        local_ranks=range(dp if local is None else local),
        handshake_bind=f"tcp://{host}:{args.data_parallel_rpc_port}" if remote else None,
        host=host,
        ready_timeout=args.engine_ready_timeout,
    )
    # Until here a signal ends start-up with an exception (the group stops what it started);
    # from here on it ends the serving loop below, which stops everything in order.
    stopping: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: stopping.append(signum))
    servers: list[subprocess.Popen] = []
    try:
        handles = group.handles()
        processes_file = Path(folder) / "processes.json"
        for index in range(count):
            servers.append(
                _start_api_server(
                    APIServerArgs(
                        attach=Attachment(handles, index, output_addrs[index]),
                        fd=listener.fileno(),
                        options=ServerOptions.from_args(args, name),
                        config=config,
                        endpoints=endpoints,
                        processes_file=str(processes_file),
                        parent_pid=os.getpid(),
                    )
                )
            )
        processes = [
            ProcessInfo("launcher", 0, os.getpid()),
            *(ProcessInfo("api", i, p.pid) for i, p in enumerate(servers)),
            *handles.processes(),
        ]
        processes_file.write_text(json.dumps([msgspec.to_builtins(p) for p in processes]))
        print(
            f"stepscope: serving {name} on http://{args.host}:{args.port}/v1 from {count} API "
            f"servers, {dp} DP ranks",
            flush=True,
        )
        while not stopping:
            dead = [i for i, p in enumerate(servers) if p.poll() is not None]
            if dead:
                code = servers[dead[0]].poll()
                raise RuntimeError(f"API server {dead[0]} exited (exit code {code})")
            time.sleep(LAUNCHER_POLL_S)
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # once: uvicorn stops gracefully, flushes spans
        for proc in servers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        group.shutdown()
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _start_api_server(args: APIServerArgs) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "stepscope.engine.entrypoints.api_server"],
        stdin=subprocess.PIPE,
        pass_fds=(args.fd,),
    )
    assert proc.stdin is not None
    proc.stdin.write(msgspec.msgpack.encode(args))
    proc.stdin.close()
    return proc


def read_processes(path: str) -> list[ProcessInfo]:
    return msgspec.json.decode(Path(path).read_bytes(), type=list[ProcessInfo])


# ---- a headless machine -------------------------------------------------------------------------
def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (what the head can reach us at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: no packet is sent, only the route is chosen
        return probe.getsockname()[0]


def run_headless(args: argparse.Namespace, config: EngineConfig) -> None:
    """Run this machine's DP ranks (or, with --nnodes, its TP workers) until the head shuts them
    down, one dies, or a signal. Their spans go to --otlp-endpoint (the head's collector)."""
    model_dir = resolve_model(config.model_config.model)
    if config.parallel_config.nnodes > 1:
        from stepscope.engine.worker.worker_proc import run_worker_node

        code = run_worker_node(config, model_dir)
        if code:
            raise SystemExit(f"stepscope: headless: the TP workers of node {args.node_rank} "
                             "stopped after a failure or a signal")  # fmt: skip
        print("stepscope: headless: TP workers stopped", flush=True)
        return
    handshake = f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}"
    me = address_towards(args.data_parallel_address)
    ranks = range(args.data_parallel_start_rank,
                   args.data_parallel_start_rank + args.data_parallel_size_local)  # fmt: skip
    stopping: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: stopping.append(signum))
    procs = {
        rank: start_core_process(
            config, Endpoints(), model_dir, rank, handshake, f"tcp://{me}:*", local, len(ranks)
        )
        for local, rank in enumerate(ranks)
    }
    print(
        f"stepscope: headless: engine cores of DP ranks {list(ranks)} (pids "
        f"{[p.pid for p in procs.values()]}) register with {handshake}",
        flush=True,
    )
    failed = None
    try:
        while not stopping:
            exited = {r: p.poll() for r, p in procs.items() if p.poll() is not None}
            if exited:
                failed = {r: c for r, c in exited.items() if c != 0} or None
                if len(exited) == len(procs) or failed:
                    break
            time.sleep(LAUNCHER_POLL_S)
    finally:
        for proc in procs.values():
            stop_process(proc)
    if failed:
        raise SystemExit(f"stepscope: headless: engine cores exited: {failed} (rank: exit code)")
    print("stepscope: headless: engine cores stopped", flush=True)
