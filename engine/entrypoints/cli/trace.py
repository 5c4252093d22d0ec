"""`stepscope trace ...`: read a finished run's trace file (or a running collector)."""

from __future__ import annotations

import argparse

TRACE = "a trace file, or a running collector's URL"


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("path", metavar="TRACE", help=TRACE)
    p.add_argument("request_id", nargs="?", default=None, help="default: the slowest request")
    p.add_argument("--json", action="store_true", help="the answer as JSON")
    p.set_defaults(func=_trace_explain)
    p = trace_sub.add_parser("slowest", help="the slowest requests, each with its largest part")
    p.add_argument("path", metavar="TRACE", help=TRACE)
    p.add_argument("-n", type=int, default=10, help="how many (default 10)")
    p.set_defaults(func=_trace_slowest)
    p = trace_sub.add_parser(
        "export", help="a timeline file for Perfetto UI (ui.perfetto.dev) or chrome://tracing"
    )
    p.add_argument("path", metavar="TRACE", help=TRACE)
    p.add_argument(
        "--format",
        choices=["chrome"],
        default="chrome",
        help="chrome: Chrome trace-event JSON (the JSON Object Format)",
    )
    p.add_argument("-o", "--output", required=True, help="the file to write, e.g. run.json")
    p.set_defaults(func=_trace_export)
    p = trace_sub.add_parser(
        "compare", help="two runs side by side: TTFT, TPOT, end-to-end, throughput, queue"
    )
    p.add_argument("a", metavar="A", help=TRACE)
    p.add_argument("b", metavar="B", help=TRACE)
    p.add_argument("--json", action="store_true", help="both runs, B/A and each request as JSON")
    p.set_defaults(func=_trace_compare)
    p = trace_sub.add_parser(
        "whatif",
        help="predict the run under other scheduler settings (the real scheduler, no model run)",
    )
    p.add_argument("path", metavar="TRACE", help=TRACE)
    p.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2,...",
        help="an engine setting and the values to try (repeat for a cartesian grid), e.g. "
        "max_num_batched_tokens=256,512,1024",
    )
    p.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="KEY=SECONDS",
        help="a limit the best setting must meet, e.g. ttft_p90=2.5 (repeatable)",
    )
    p.add_argument(
        "--json", action="store_true", help="only the list of settings' predictions on stdout"
    )
    p.set_defaults(func=_trace_whatif)
    _register_replay(trace_sub)


def _register_replay(trace_sub: argparse._SubParsersAction) -> None:
    p = trace_sub.add_parser(
        "replay",
        help="run a recorded workload again on a fresh engine, settings changed, into a new trace",
        description="Send the recorded requests again, each at its recorded offset with its "
        "recorded prompt length, shared prefixes, sampling parameters and output length, to a "
        "fresh engine running the recorded configuration with only the --set options changed, "
        "through the recorded entry path (an offline run through LLM here, a served run through "
        "a stepscope serve started here and stopped at the end), recording a new trace at -o.",
    )
    p.add_argument("path", metavar="TRACE", help=TRACE)
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option to change, by its EngineConfig name (max_num_batched_tokens, "
        "max_num_seqs, num_kv_blocks, enable_prefix_caching, ...); repeat for several",
    )
    p.add_argument("-o", "--output", help="the new trace file (required unless --url)")
    p.add_argument(
        "--url",
        help="replay against this running server instead: nothing is started, its settings "
        "stay as they are (no --set), and the replayed requests are recorded in that server's "
        "own trace file (its --trace-db), not in -o",
    )
    p.add_argument("--api-key", default=None, help="with --url: 'Authorization: Bearer KEY'")
    p.set_defaults(func=_trace_replay)


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


def _trace_replay(args: argparse.Namespace) -> int:
    from stepscope.engine.bench.replay import trace_replay

    return trace_replay(args)


def _trace_compare(args: argparse.Namespace) -> int:
    from stepscope.traces.backend.compare import trace_compare

    return trace_compare(args.a, args.b, as_json=args.json)


def _trace_whatif(args: argparse.Namespace) -> int:
    from stepscope.viz.whatif_report import trace_whatif

    return trace_whatif(args.path, args.grid, args.slo, as_json=args.json)
