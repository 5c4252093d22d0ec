"""The `stepscope` command line: prepare models, run the demo, serve, read traces, show the
dashboard, run benchmarks."""

from __future__ import annotations

import argparse
import sys

from stepscope.engine.models.loader import BUILTIN_MODELS, DEFAULT_MODEL


def _prepare(args: argparse.Namespace) -> None:
    from stepscope.engine.models.loader import resolve_model

    for model in args.model or [DEFAULT_MODEL]:
        print(f"{model}: {resolve_model(model)}")


def _demo(args: argparse.Namespace) -> None:
    from stepscope.engine.entrypoints.demo import run_demo

    run_demo(args.model, args.port, args.dashboard_port, wait=not args.no_wait)


def _serve(args: argparse.Namespace) -> None:
    from stepscope.engine.entrypoints.serve import serve

    serve(args)


def _trace_summary(args: argparse.Namespace) -> None:
    from stepscope.traces.backend.cli import trace_summary

    trace_summary(args.path)


def _trace_request(args: argparse.Namespace) -> int:
    from stepscope.traces.backend.cli import trace_request

    return trace_request(args.path, args.request_id)


def _trace_explain(args: argparse.Namespace) -> int:
    from stepscope.traces.backend.cli import trace_explain

    return trace_explain(args.path, args.request_id, as_json=args.json)


def _trace_slowest(args: argparse.Namespace) -> int:
    from stepscope.traces.backend.cli import trace_slowest

    return trace_slowest(args.path, args.n)


def _trace_export(args: argparse.Namespace) -> None:
    from stepscope.traces.backend.cli import trace_export

    trace_export(args.path, args.output, args.format)


def _bench_offline(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.offline import bench_offline

    bench_offline(args)


def _bench_serve(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.serve import bench_serve

    bench_serve(args)


def _bench_sampling(args: argparse.Namespace) -> int:
    from stepscope.engine.bench.sampling import run_bench_sampling

    return run_bench_sampling(args.model, args.streams, args.max_tokens, args.dtype)


def _bench_soak(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.soak import bench_soak

    if not bench_soak(args):
        sys.exit(1)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The benchmark workload (`bench.make_workload`) and the engine budget both benchmarks
    share (for `bench serve`: the offline engine of --compare-offline and servers it starts)."""
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=768)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepscope", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="build the cached weights of built-in models")
    p.add_argument("--model", action="append", choices=BUILTIN_MODELS)
    p.set_defaults(func=_prepare)

    p = sub.add_parser("demo", help="serve the default model, run a sample workload, show it")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dashboard-port", type=int, default=5006)
    p.add_argument("--no-wait", action="store_true", help="stop once the workload is done")
    p.set_defaults(func=_demo)

    p = sub.add_parser("serve", help="the OpenAI-compatible server, engine core and workers")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told)")
    p.add_argument("--port", type=int, default=8000)
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
        "--api-server-count",
        type=int,
        default=1,
        help="API-server processes sharing the port, each connected to every engine core",
    )
    scale = p.add_argument_group("more than one machine (docs/scaling.md)")
    scale.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="DP ranks whose engine cores run on this machine (default: all of them)",
    )
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
        "--nnodes",
        type=int,
        default=1,
        help="machines one engine's TP workers are spread over (--tp is the total)",
    )
    scale.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's index among --nnodes (0: the engine core's; others: --headless)",
    )
    scale.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="node 0's address: the workers' sockets and torch.distributed's rendezvous",
    )
    scale.add_argument(
        "--master-port",
        type=int,
        default=29500,
        help="torch.distributed's port on node 0 (the workers' sockets take the next two)",
    )
    scale.add_argument(
        "--engine-ready-timeout",
        type=float,
        default=600.0,
        help="seconds the head waits for every DP rank (local or remote) to be ready",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None)
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace-db",
        default=None,
        help="DuckDB file for the spans (default: runs/serve-<time>.duckdb)",
    )
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
    p.set_defaults(func=_serve, collector_extensions=())

    trace = sub.add_parser("trace", help="read a finished run's trace file")
    trace_sub = trace.add_subparsers(dest="trace", required=True)
    p = trace_sub.add_parser("summary", help="span counts, crossings, steps and latencies")
    p.add_argument("path")
    p.set_defaults(func=_trace_summary)
    p = trace_sub.add_parser("request", help="one request's path and the steps that served it")
    p.add_argument("path")
    p.add_argument("request_id")
    p.set_defaults(func=_trace_request)
    p = trace_sub.add_parser(
        "explain", help="why a request (default: the slowest) took as long as it did"
    )
    p.add_argument("path", metavar="TRACE", help="a trace file, or a running collector's URL")
    p.add_argument("request_id", nargs="?", default=None, help="default: the slowest request")
    p.add_argument("--json", action="store_true", help="the answer as JSON")
    p.set_defaults(func=_trace_explain)
    p = trace_sub.add_parser("slowest", help="the slowest requests, each with its largest part")
    p.add_argument("path", metavar="TRACE", help="a trace file, or a running collector's URL")
    p.add_argument("-n", type=int, default=10, help="how many (default 10)")
    p.set_defaults(func=_trace_slowest)
    p = trace_sub.add_parser(
        "export", help="a timeline file for Perfetto UI (ui.perfetto.dev) or chrome://tracing"
    )
    p.add_argument("path", metavar="TRACE", help="a trace file, or a running collector's URL")
    p.add_argument(
        "--format",
        choices=["chrome"],
        default="chrome",
        help="chrome: Chrome trace-event JSON (the JSON Object Format)",
    )
    p.add_argument("-o", "--output", required=True, help="the file to write, e.g. run.json")
    p.set_defaults(func=_trace_export)

    p = sub.add_parser("dashboard", help="the dashboard: a trace file, a live collector, or none")
    # The dashboard sits above the engine: its module (light: no Panel until it runs) is
    # imported here, in the command line only.
    from stepscope.viz import dashboard

    dashboard.add_arguments(p)
    p.set_defaults(func=dashboard.run)

    bench = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    p = bench_sub.add_parser("offline", help="stepscope vs transformers generate, one run")
    p.add_argument("--model", default=DEFAULT_MODEL)
    _add_workload_args(p)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per setting; with --tracing off,on the order alternates run by run",
    )
    p.add_argument(
        "--executor",
        default="uni",
        help="uni, mp, or both as 'uni,mp' to compare them side by side in one run",
    )
    p.add_argument(
        "--tracing",
        default="off",
        help="off, on (spans into a DuckDB file), or 'off,on' to compare them in one run",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32, bfloat16, or 'float32,bfloat16': the whole comparison once per dtype",
    )
    p.add_argument(
        "--dp",
        default="1",
        help="data-parallel sizes, e.g. '1,2': stepscope once per size side by side, with "
        "throughput and TTFT (each rank gets cores / DP torch threads)",
    )
    p.add_argument(
        "--force-dtype",
        action="store_true",
        help="run a dtype even where its matmul is emulated on this CPU (slow)",
    )
    p.set_defaults(func=_bench_offline)

    p = bench_sub.add_parser("serve", help="the same workload, streamed to a running server")
    p.add_argument("--url", default=None, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--tracing",
        default=None,
        help="instead of --url: start a server per setting (off, requests, on; e.g. off,on), "
        "run the workload against each in turn and print their throughput ratio",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each side (each tracing setting, the server, the offline engine), in "
        "alternating order; a replay against --url empties its prefix cache first",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="with --tracing: the servers' dtype (with --url the offline run takes the server's)",
    )
    p.add_argument("--tp", type=int, default=1, help="with --tracing: tensor-parallel size")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: C clients")
    load.add_argument(
        "--request-rate", type=float, default=None, help="open loop: Poisson arrivals, req/s"
    )
    p.add_argument("--model", default=None, help="default: the model the server lists")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the stepscope model or checkpoint folder whose vocabulary the prompt ids come "
        "from (default: --model); for a server that names its model otherwise, e.g. llama.cpp",
    )
    p.add_argument("--api-key", default=None)
    _add_workload_args(p)
    p.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="with --url: empty the server's prefix cache first (POST /reset_prefix_cache), so "
        "that a workload it served before is computed again",
    )
    p.add_argument(
        "--compare-offline",
        action="store_true",
        help="also run the workload through LLM(...) here, in turn with the server, and print "
        "server / offline tok/s, run by run and over all runs",
    )
    p.set_defaults(func=_bench_serve, executor="uni")

    p = bench_sub.add_parser(
        "sampling", help="a traced server's sample spans against its forward spans"
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", type=int, default=16, help="concurrent sampled chat streams")
    p.add_argument("--max-tokens", type=int, default=64, help="per stream")
    p.set_defaults(func=_bench_sampling)

    p = bench_sub.add_parser(
        "soak", help="rounds of streams, disconnects, aborts and hostile bodies; checks recovery"
    )
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=64, help="concurrent streams per round")
    p.add_argument("--disconnects", type=int, default=16, help="streams cut after 3 chunks")
    p.add_argument("--aborts", type=int, default=8, help="requests the client gives up on")
    p.add_argument(
        "--abort-after", type=float, default=1.0, help="seconds before an abort gives up"
    )
    p.add_argument("--max-prompt", type=int, default=200, help="longest prompt, tokens")
    p.add_argument("--max-output", type=int, default=48, help="longest stream output, tokens")
    p.add_argument("--model", default=None, help="default: the model the server lists")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the stepscope model or checkpoint folder whose vocabulary the prompt ids come "
        "from (default: --model); for a server that names its model otherwise, e.g. llama.cpp",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_bench_soak)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as e:
        print(f"stepscope: {e}", file=sys.stderr)
        sys.exit(2)
    if code:  # a command that found nothing to show (an unknown request id)
        sys.exit(code)


if __name__ == "__main__":
    main()
