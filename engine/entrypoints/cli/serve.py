"""`stepscope serve` (the OpenAI-compatible server, engine core and workers) and `stepscope demo`.

The engine's flags are generated from `EngineConfig`'s fields (engine/engine_args.py), apart
from the flags of the server and of the machines that run it.
"""

from __future__ import annotations

import argparse

from stepscope.engine.engine_args import add_engine_args
from stepscope.engine.entrypoints.tool_parsers import TOOL_CALL_PARSERS
from stepscope.engine.models.loader import DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve the default model, run a sample workload, show it")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dashboard-port", type=int, default=5006)
    p.add_argument("--no-wait", action="store_true", help="stop once the workload is done")
    p.set_defaults(func=_demo)

    p = sub.add_parser("serve", help="the OpenAI-compatible server, engine core and workers")
    _add_server_args(p)
    # Generated from EngineConfig's fields (--model, the budget, parallelism, tracing, ...); a
    # server runs its workers in their own processes unless told, and schedules the next step
    # while the current one's forward runs (`--no-async-scheduling` to turn it off): with the
    # worker in its own process it was as fast or faster at 1, 8 and 48 streams
    # (docs/benchmarks.md, "2026-12-05, late"), as in vLLM, where it is the default.
    add_engine_args(p, defaults={"executor": "mp", "async_scheduling": True})
    _add_deployment_args(p)
    p.set_defaults(func=_serve, collector_extensions=())


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """The API server: its model name, address, processes, key, queue and dashboard."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API-server processes sharing the port, each connected to every engine core",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests held at once; past it the server answers 503 + Retry-After",
    )
    p.add_argument(
        "--api-server-niceness",
        type=int,
        default=0,
        help="how far the API servers lower their CPU priority once the engine runs, so that "
        "on a small CPU they do not preempt its forward (e.g. 10; default 0: unchanged)",
    )
    p.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="add vLLM's per-request `metrics` object (queue time, TTFT, decode time, mean ITL, "
        "tokens/s) to completion and chat responses (streamed: to the final usage chunk)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="find tool calls in free text, for `tool_choice: auto` on a model whose chat "
        "template renders tools (vLLM's flag; hermes: <tool_call>{...}</tool_call>, Qwen's "
        "and Hermes' format). Without it `auto` is refused; `required` and a named function "
        "work on every model",
    )
    p.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        help="also serve the live dashboard on this port (from the collector)",
    )
    p.add_argument(
        "--no-trace",
        action="store_true",
        help="record no spans at all: no collector, no trace file (for benchmarks)",
    )


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    """The head and headless machines: which DP ranks run here and where they register."""
    scale = p.add_argument_group("more than one machine (docs/scaling.md)")
    scale.add_argument(
        "--data-parallel-start-rank",
        type=int,
        default=0,
        help="with --headless: the first DP rank this machine runs",
    )
    scale.add_argument(
        "--data-parallel-address",
        default="127.0.0.1",
        help="the head's address: engine cores on other machines register there",
    )
    scale.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=29550,
        help="the head's port for engine-core registration",
    )
    scale.add_argument(
        "--headless",
        action="store_true",
        help="run only engine cores (DP ranks from --data-parallel-start-rank), registered "
        "with the head at --data-parallel-address; no API server",
    )
    scale.add_argument(
        "--engine-ready-timeout",
        type=float,
        default=600.0,
        help="seconds the head waits for every DP rank (local or remote) to be ready",
    )


def _demo(args: argparse.Namespace) -> None:
    from stepscope.engine.entrypoints.demo import run_demo

    run_demo(args.model, args.port, args.dashboard_port, wait=not args.no_wait)


def _serve(args: argparse.Namespace) -> None:
    from stepscope.engine.entrypoints.serve import serve

    serve(args)
