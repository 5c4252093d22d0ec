"""`stepscope serve`: the API server process, which starts the engine core and its workers."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import uvicorn

from stepscope.engine.api_server import build_app
from stepscope.engine.async_llm import AsyncLLM
from stepscope.traces import names
from stepscope.traces.collector import start_collector_process, stop_collector_process
from stepscope.traces.setup import init_process_tracing, shutdown_tracing


def default_trace_db() -> Path:
    return Path("runs") / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.duckdb"


def serve(args: argparse.Namespace) -> None:
    trace_db = Path(args.trace_db) if args.trace_db else default_trace_db()
    trace_db.parent.mkdir(parents=True, exist_ok=True)
    engine_args = dict(
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend,
        seed=args.seed,
        executor=args.executor,
        tensor_parallel_size=args.tp,
        otlp_endpoint=args.otlp_endpoint,
        trace_steps=args.trace_steps,
    )
    name = args.served_model_name or args.model
    # Validate the configuration before anything starts, so a typo fails fast and clearly.
    from stepscope.engine.config import EngineConfig

    EngineConfig(model=args.model, offline=False, **engine_args)
    # The collector owns the trace file while we run; every process sends it spans over OTLP.
    extensions = list(args.collector_extensions)
    if args.dashboard_port is not None:
        # The live dashboard runs inside the collector, which owns the trace file.
        os.environ["STEPSCOPE_DASHBOARD_PORT"] = str(args.dashboard_port)
        extensions.append("stepscope.viz.dashboard:mount_on_collector")
    collector, collector_url = start_collector_process(str(trace_db), extensions=extensions)
    engine_args["collector_endpoint"] = collector_url
    init_process_tracing(
        names.SERVICE_API,
        collector_endpoint=collector_url,
        otlp_endpoint=args.otlp_endpoint,
        trace_steps=args.trace_steps,
    )
    app = build_app(
        lambda: AsyncLLM(args.model, **engine_args),
        model_name=name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
    )
    print(f"stepscope: serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    print(f"stepscope: traces -> {trace_db} (collector {collector_url})", flush=True)
    if args.dashboard_port is not None:
        print(f"stepscope: dashboard on http://127.0.0.1:{args.dashboard_port}", flush=True)
    try:
        uvicorn.run(
            app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
        )
    finally:
        try:
            dropped = shutdown_tracing()
        finally:
            stop_collector_process(collector)
        note = f", {dropped} spans dropped in the API process" if dropped else ""
        print(f"stepscope: trace saved to {trace_db}{note}", flush=True)
