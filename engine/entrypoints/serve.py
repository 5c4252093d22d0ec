"""`stepscope serve`: the API server process, which starts the engine core and its workers."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvicorn

from stepscope.engine.config import Endpoints, EngineConfig, init_engine_process_tracing
from stepscope.engine.entrypoints.api_server import build_app
from stepscope.engine.entrypoints.serving import ServerOptions
from stepscope.engine.frontend.async_llm import AsyncLLM
from stepscope.traces import names
from stepscope.traces.backend.collector_process import (
    describe_summary,
    start_collector_process,
    stop_collector_process,
)
from stepscope.traces.process import (
    PARENT_ENV,
    exit_once_on,
    free_port,
    watch_parent_from_env,
)
from stepscope.traces.setup import shutdown_tracing


def default_trace_db() -> Path:
    return Path("runs") / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.duckdb"


def serve(args: argparse.Namespace) -> None:
    watch_parent_from_env()  # started by the demo or a benchmark: end with it
    tracing = not args.no_trace
    if not tracing and (args.trace_db or args.otlp_endpoint or args.dashboard_port is not None):
        raise ValueError(
            "--no-trace records nothing: drop --trace-db, --otlp-endpoint and "
            "--dashboard-port, or drop --no-trace"
        )
    from stepscope.engine.engine_args import engine_config_from_args
    from stepscope.engine.entrypoints import launcher
    from stepscope.engine.models.config import read_model_shape
    from stepscope.engine.models.loader import resolve_config, resolve_model

    # The configuration, built and validated once before anything starts (a typo fails fast
    # and clearly), and sent whole to every process.
    trace_db = args.trace_db or (str(default_trace_db()) if tracing else None)
    config = engine_config_from_args(args, offline=False, trace_db=trace_db)
    launcher.check_scale_out_args(args)
    model_dir = resolve_model(config.model_config.model)
    # A checkpoint it cannot run is refused.
    read_model_shape(model_dir, config.parallel_config.tensor_parallel_size)
    # dtype and quantization "auto" are decided once, here, so that every process runs the
    # same weights in the same dtype.
    config = resolve_config(config, model_dir)
    m = config.model_config
    print(f"stepscope: weights {m.weight_format}; dtype {m.dtype} ({m.dtype_reason})", flush=True)
    if args.headless:
        launcher.run_headless(args, config)
        return
    name = args.served_model_name or config.model_config.model
    # One API server with every rank on this machine: this process is the API server, and its
    # AsyncLLM starts the engine. Otherwise this process launches everything (launcher.py).
    run = _run if not launcher.needs_launcher(args) else launcher.launch
    if not tracing:
        run(args, config, Endpoints(), name)
        return
    Path(trace_db).parent.mkdir(parents=True, exist_ok=True)
    # The collector owns the trace file while we run; every process sends it spans over OTLP.
    extensions = list(args.collector_extensions)
    if args.dashboard_port is not None:
        # The live dashboard runs inside the collector, which owns the trace file.
        os.environ["STEPSCOPE_DASHBOARD_PORT"] = str(args.dashboard_port)
        extensions.append("stepscope.viz.dashboard:mount_on_collector")
    # Engine cores on other machines send their spans here too: listen where they can reach.
    host = args.data_parallel_address if launcher.has_remote_ranks(args) else "127.0.0.1"
    collector, collector_url = start_collector_process(trace_db, host=host, extensions=extensions)
    endpoints = Endpoints(collector=collector_url)
    init_engine_process_tracing(names.SERVICE_API, config, endpoints)
    print(f"stepscope: traces -> {trace_db} (collector {collector_url})", flush=True)
    if args.dashboard_port is not None:
        print(f"stepscope: dashboard on http://127.0.0.1:{args.dashboard_port}", flush=True)
    try:
        run(args, config, endpoints, name)
    finally:
        # Every other process has stopped and flushed by now (run() returns after the engine
        # cores, workers and API servers have exited): this process's spans, then the
        # collector, last.
        try:
            shutdown_tracing()
        finally:
            summary = stop_collector_process(collector)
        print(f"stepscope: trace saved to {trace_db}: {describe_summary(summary)}", flush=True)


def _run(args: argparse.Namespace, config: EngineConfig, endpoints: Endpoints, name: str) -> None:
    """Serve the OpenAI API until SIGINT/SIGTERM."""
    app = build_app(
        lambda: AsyncLLM(config=config, endpoints=endpoints, model_name=name),
        ServerOptions.from_args(args, name),
    )
    note = "" if not args.no_trace else " (--no-trace: no spans recorded)"
    print(f"stepscope: serving {name} on http://{args.host}:{args.port}/v1{note}", flush=True)
    # uvicorn shuts down cleanly on SIGINT and SIGTERM, then raises the signal again with the
    # handler it found: for SIGTERM that must be an exit that unwinds (the caller then closes
    # the trace), not the default kill. A hang-up (the terminal closed) stops it the same way.
    exit_once_on(signal.SIGTERM)
    signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
    )


class ServerProcess:
    """`stepscope serve ARGS` in a child process on loopback, waited for until /health answers.

    Used by `make demo` and by `stepscope bench serve --tracing`, which starts one server per
    tracing setting. It runs in its own session; `stop()` sends SIGINT, as Ctrl-C would (the
    server flushes its trace), and kills the whole group (engine core, workers, collector) if
    that does not end it.
    """

    def __init__(self, *serve_args: str, port: int | None = None, timeout: float = 600) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "stepscope.engine.entrypoints.cli", "serve",
                    "--port", str(self.port), *serve_args]  # fmt: skip
        # Its own session, so a Ctrl-C meant for the caller's terminal is ours to pass on; and
        # told our pid, so that it stops itself if we are killed before we can stop it.
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        self.proc = subprocess.Popen(self.cmd, start_new_session=True, env=env)
        try:
            wait_healthy(self.url, self.proc, timeout)
        except BaseException:
            self.stop()
            raise

    def wait(self) -> int:
        return self.proc.wait()

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `stepscope serve` at `url` answers /health; an error if it exits or stays silent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stepscope serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"stepscope serve did not answer /health within {timeout:.0f} s")
