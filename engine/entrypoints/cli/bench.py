"""`stepscope bench ...`: benchmarks that print side-by-side ratios (engine/bench/)."""

from __future__ import annotations

import argparse
import sys

from stepscope.engine.engine_args import add_engine_args
from stepscope.engine.models.loader import DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    _add_offline(bench_sub)
    _add_serve(bench_sub)
    _add_sampling(bench_sub)
    _add_soak(bench_sub)
    _add_latency(bench_sub)
    _add_accuracy(bench_sub)
    _add_whatif(bench_sub)
    _add_hybrid_kv(bench_sub)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The benchmark workload (`bench.make_workload`) and the engine budget both benchmarks
    share (for `bench serve`: the offline engine of --compare-offline and servers it starts)."""
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=768)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=192)
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p, only=("max_num_batched_tokens", "max_num_seqs"))


def _add_client_args(p: argparse.ArgumentParser) -> None:
    """A client of a running server: the model it asks for, the vocabulary of its prompt ids,
    its API key."""
    p.add_argument("--model", default=None, help="default: the model the server lists")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the stepscope model or checkpoint folder whose vocabulary the prompt ids come "
        "from (default: --model); for a server that names its model otherwise, e.g. llama.cpp",
    )
    p.add_argument("--api-key", default=None)


def _add_offline(bench_sub: argparse._SubParsersAction) -> None:
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
        "--data-parallel-backend",
        default="mp",
        help="mp, ray, or 'mp,ray': how the DP ranks' engine cores start (processes or Ray "
        "actors); with both, their runs alternate and throughput and start-up are compared",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        help="auto, gguf, none, or 'gguf,none': the whole comparison once per setting",
    )
    p.add_argument(
        "--force-dtype",
        action="store_true",
        help="run a dtype even where its matmul is emulated on this CPU (slow)",
    )
    p.add_argument(
        "--async-scheduling",
        default="off",
        help="off, on, or 'off,on': the whole comparison once per setting",
    )
    p.set_defaults(func=_bench_offline)


def _add_serve(bench_sub: argparse._SubParsersAction) -> None:
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
    _add_client_args(p)
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


def _add_sampling(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "sampling", help="a traced server's sample spans against its forward spans"
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", type=int, default=16, help="concurrent sampled chat streams")
    p.add_argument("--max-tokens", type=int, default=64, help="per stream")
    p.add_argument(
        "--structured",
        action="store_true",
        help="structured outputs instead: the grammar bitmask's spans against the forward's "
        "with --streams JSON-schema streams, and plain streams' inter-token latency while a "
        "2,000-property schema compiles (offline, engine core and worker in their own processes)",
    )
    p.set_defaults(func=_bench_sampling)


def _add_soak(bench_sub: argparse._SubParsersAction) -> None:
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
    _add_client_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_bench_soak)


def _bench_offline(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.offline import bench_offline

    bench_offline(args)


def _bench_serve(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.serve import bench_serve

    bench_serve(args)


def _bench_sampling(args: argparse.Namespace) -> int:
    if args.structured:
        from stepscope.engine.bench.structured import run_bench_structured

        return run_bench_structured(args.model, args.streams, args.max_tokens, args.dtype)
    from stepscope.engine.bench.sampling import run_bench_sampling

    return run_bench_sampling(args.model, args.streams, args.max_tokens, args.dtype)


def _bench_soak(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.soak import bench_soak

    if not bench_soak(args):
        sys.exit(1)


def _add_latency(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "latency", help="one request at a time (llama-bench's tg128): ms per output token"
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="runs a setting, after one warm-up")
    p.add_argument(
        "--quantization", default="gguf,none", help="settings side by side: gguf, none, auto"
    )
    p.add_argument("--dtype", default="bfloat16", help="e.g. bfloat16,float32")
    p.add_argument("--async-scheduling", default="off", help="off, on, or off,on")
    p.add_argument("--executor", default="uni", choices=["uni", "mp"])
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="then time each part of a decode step around its call (engine core step, input "
        "preparation, forward, LM head, sampling) and what the front end adds",
    )
    p.set_defaults(func=_bench_latency)


def _bench_latency(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.latency import bench_latency

    bench_latency(args)


def _add_accuracy(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "accuracy", help="quantized weights against the same weights dequantized (float32)"
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", help="the quantized run's activations")
    p.set_defaults(func=_bench_accuracy)


def _bench_accuracy(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.accuracy import bench_accuracy

    bench_accuracy(args)


def _add_whatif(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "whatif", help="trace whatif's predictions against replays of three recorded workloads"
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="tiny-llama for a quick run")
    p.add_argument(
        "--workloads",
        default="bursty_chat,long_prompt,small_pool",
        help="which of the three to record, comma-separated",
    )
    p.add_argument("--chats", type=int, default=32, help="bursty chat: requests")
    p.add_argument("--short-chats", type=int, default=24, help="long prompt: the short chats")
    p.add_argument("--long-prompt", type=int, default=1024, help="long prompt: its tokens")
    p.add_argument("--pool-chats", type=int, default=24, help="small pool: requests")
    p.add_argument("--max-prompt", type=int, default=400, help="longest chat prompt, tokens")
    p.add_argument("--max-output", type=int, default=128, help="longest chat output, tokens")
    p.add_argument("--replays", type=int, default=2, help="replays of each setting (>= 2)")
    p.add_argument(
        "--grid-requests",
        type=int,
        default=1000,
        help="requests of the hand-made bursty chat mix the 9-setting grid is timed on (0: none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--traces", default=None, help="keep the recorded and replayed traces in this folder"
    )
    p.add_argument("--out", default=None, help="write every number as JSON to this file")
    p.set_defaults(func=_bench_whatif)


def _bench_whatif(args: argparse.Namespace) -> int:
    from stepscope.engine.bench.whatif import bench_whatif
    from stepscope.viz import whatif  # engine/ sits below viz/: the predictor is handed in

    return bench_whatif(args, whatif)


def _add_hybrid_kv(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "hybrid-kv",
        help="one KV pool, the hybrid KV cache manager on and off: requests at once, throughput",
    )
    p.add_argument("--model", default="gemma-3-270m", help="a model with sliding-window layers")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument(
        "--pool-requests",
        type=int,
        default=4,
        help="the pool's bytes: this many requests whole with every layer keeping every block",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1, help="rounds, the order alternating")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_bench_hybrid_kv)


def _bench_hybrid_kv(args: argparse.Namespace) -> None:
    from stepscope.engine.bench.hybrid_kv import bench_hybrid_kv

    bench_hybrid_kv(args)
