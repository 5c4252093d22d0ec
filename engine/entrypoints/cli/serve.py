"""`stepscope serve` (the OpenAI-compatible server, engine core and workers) and `stepscope demo`.

The engine's flags are `add_engine_args`, apart from the flags of the server and of the machines
that run it.
"""

from __future__ import annotations

import argparse

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
    add_engine_args(p)
    _add_deployment_args(p)
    p.set_defaults(func=_serve, collector_extensions=())


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """The API server: its model name, address, processes, key, queue and trace file."""
    p.add_argument("--model", default=DEFAULT_MODEL)
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
        "--trace-db",
        default=None,
        help="DuckDB file for the spans (default: runs/serve-<time>.duckdb)",
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of the engine: parallelism, executor, device, KV cache, scheduling budget,
    attention, sampling seed and tracing."""
    p = parser.add_argument_group("engine")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument(
        "--dp",
        "--data-parallel-size",
        dest="dp",
        type=int,
        default=1,
        help="engine cores, each with its own scheduler, KV pool and TP workers",
    )
    p.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="DP ranks whose engine cores run on this machine (default: all of them)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines one engine's TP workers are spread over (--tp is the total)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's index among --nnodes (0: the engine core's; others: --headless)",
    )
    p.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="node 0's address: the workers' sockets and torch.distributed's rendezvous",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=29500,
        help="torch.distributed's port on node 0 (the workers' sockets take the next two)",
    )
    p.add_argument("--executor", choices=["uni", "mp"], default="mp")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: the checkpoint's dtype where this device runs it natively, else float32",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument(
        "--attention-backend",
        choices=["cpu", "torch", "triton"],
        default=None,
        help="default: triton on CUDA; on a CPU, cpu (a C decode kernel) where a C compiler "
        "builds it, else torch",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        help="also send every span to this OTLP/HTTP endpoint (Jaeger, Phoenix, ...)",
    )
    p.add_argument(
        "--trace-steps",
        default="all",
        help="which steps record spans: all, every:N or off (requests always do)",
    )
    p.add_argument(
        "--trace-content",
        action="store_true",
        help="put each request's prompt and generated text on its span (input.value, "
        "output.value); off by default, as prompts can be private",
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
