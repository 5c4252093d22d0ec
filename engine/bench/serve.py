"""`stepscope bench serve`: the standard workload replayed against an OpenAI-compatible server
(serve_client.py sends it and times each stream), printing the numbers `vllm bench serve` prints
and, with --compare-offline, the ratio of the server's output throughput to the offline engine's
on the same workload, the two taking turns over `--repeat` runs.

With `--tracing off,on` (instead of `--url`) it starts a fresh `stepscope serve` for each tracing
setting (`off` is `--no-trace`, `requests` is `--trace-steps off`, `on` traces every step), runs
the workload against each in turn, `--repeat` times in alternating order, and prints the ratio of
their output throughput: what tracing costs a server, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from stepscope.engine.bench.offline import Workload, alternating, make_workload
from stepscope.engine.bench.serve_client import (
    BenchResult,
    format_result,
    run_bench_serve,
    served_model_card,
)

TRACING_SETTINGS = {
    "off": ["--no-trace"],  # no collector, no spans at all
    "requests": ["--trace-steps", "off"],  # request spans only
    "on": ["--trace-steps", "all"],  # every step, worker step and crossing
}


def _check_args(args: argparse.Namespace) -> list[str]:
    for low, high in ((args.min_prompt, args.max_prompt), (args.min_output, args.max_output)):
        if not 1 <= low <= high:
            raise ValueError(f"length ranges must satisfy 1 <= min <= max, got {low}-{high}")
    if (args.url is None) == (args.tracing is None):
        raise ValueError("give either --url (a running server) or --tracing (servers started here)")
    alternating(["server"], args.repeat)  # checks --repeat before any request is sent
    if args.tracing is None:
        return []
    settings = [t.strip() for t in args.tracing.split(",")]
    unknown = [t for t in settings if t not in TRACING_SETTINGS]
    if unknown or len(set(settings)) != len(settings):
        raise ValueError(
            f"--tracing takes distinct values among {', '.join(TRACING_SETTINGS)}, "
            f"got {args.tracing!r}"
        )
    return settings


def bench_serve(args: argparse.Namespace) -> None:
    from stepscope.engine.models.loader import load_config, resolve_model

    settings = _check_args(args)
    # The offline comparison runs the dtype the server runs: the one asked for here when this
    # starts the servers, else the one the server reports (float32 where it reports none).
    dtype = args.dtype
    if settings:
        from stepscope.engine.config import device_tier_defaults
        from stepscope.engine.models.loader import DEFAULT_MODEL

        model = args.model or DEFAULT_MODEL
        # The servers' budget, written out, so that the offline comparison runs the same one
        # (offline, `LLM` would take the larger offline tier).
        budget, seqs = device_tier_defaults("cpu", offline=False)
        args.max_num_batched_tokens = args.max_num_batched_tokens or budget
        args.max_num_seqs = args.max_num_seqs or seqs
    else:

        async def card() -> dict:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers) as client:
                return await served_model_card(client)

        served = asyncio.run(card())
        model = args.model or served["id"]
        dtype = served.get("dtype", "float32")
        for field in ("max_num_batched_tokens", "max_num_seqs"):  # the server's own budget
            if getattr(args, field) is None and field in served:
                setattr(args, field, served[field])
    if dtype == "auto":  # what the servers started here resolve it to, named in the report
        from stepscope.engine.config import auto_dtype, checkpoint_dtype

        dtype = auto_dtype(checkpoint_dtype(resolve_model(model)), "cpu")[0]
    try:
        vocab_size = load_config(resolve_model(args.tokenizer or model))["vocab_size"]
    except ValueError as e:
        raise ValueError(
            f"{e}; the prompts are token ids drawn from a vocabulary: name it with --tokenizer "
            "(a stepscope model or a local checkpoint folder)"
        ) from None
    workload = make_workload(
        args.num_requests,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        vocab_size,
        args.seed,
    )
    n_prompt = sum(len(p) for p in workload.prompts)
    where = f"server {args.url}" if args.url else f"servers started here, tracing {args.tracing}"
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus; {where}, model {model}")
    print(
        f"workload: {args.num_requests} requests (seed {args.seed}), prompts "
        f"{args.min_prompt}-{args.max_prompt} tokens ({n_prompt} in all), outputs "
        f"{args.min_output}-{args.max_output} ({workload.num_output_tokens} in all), greedy, "
        "ignore_eos, streamed"
    )
    offline_s: list[float] = []  # the offline engine's seconds, one per run

    def offline_run(rep: int) -> None:
        # Only with no server running, so that the two never share the cores.
        from stepscope.engine.bench.offline import run_stepscope

        elapsed, _ = run_stepscope(model, workload, args, dtype=dtype)
        offline_s.append(elapsed)
        print(
            f"offline {dtype} run {rep + 1}: {elapsed:7.1f} s  "
            f"{workload.num_output_tokens / elapsed:6.1f} output tok/s",
            flush=True,
        )

    offline = offline_run if args.compare_offline else None
    if settings:
        served = compare_tracing(model, workload, settings, args, offline)[settings[0]]
    else:
        served = []
        sides = ["server", "offline"] if offline else ["server"]
        for rep, setting in alternating(sides, args.repeat):
            if setting == "offline":
                offline_run(rep)
                continue
            res = run_bench_serve(
                args.url,
                workload,
                args.concurrency,
                args.request_rate,
                args.api_key,
                model,
                args.seed,
                # A replay would find every prompt in the prefix cache.
                args.reset_prefix_cache or rep > 0,
            )
            served.append(res)
            if args.repeat > 1:
                print(_run_line(f"server run {rep + 1}:", res), flush=True)
                _notes(res, workload)
        print(format_result(served[0]))
        if args.repeat == 1:
            _notes(served[0], workload)
    if offline:
        print(format_offline(served, offline_s, workload.num_output_tokens, dtype))


def _run_line(label: str, res: BenchResult) -> str:
    return (
        f"{label:<24} {res.duration_s:7.1f} s  {res.output_throughput:6.1f} output tok/s  "
        f"TTFT p50 {res.ttft.median_ms:7.0f} ms  TPOT p50 {res.tpot.median_ms:5.0f} ms  "
        f"failed {res.failed}"
    )


def format_offline(
    served: list[BenchResult], offline_s: list[float], num_tokens: int, dtype: str
) -> str:
    """The server's output throughput against the offline engine's, run by run (the runs
    alternate, so that a machine drifting during the benchmark favours neither), then over all
    runs: all tokens over all seconds, each side."""
    lines = [f"{' Server against offline, ' + dtype + ' ':=^50}"]
    for i, (res, seconds) in enumerate(zip(served, offline_s, strict=True)):
        ratio = res.output_throughput / (num_tokens / seconds)
        lines.append(
            f"run {i + 1}: server {res.output_throughput:6.1f}, offline "
            f"{num_tokens / seconds:6.1f} output tok/s: {ratio:.3f}x"
        )
    server_tok_s = sum(r.total_output_tokens for r in served) / sum(r.duration_s for r in served)
    offline_tok_s = num_tokens * len(offline_s) / sum(offline_s)
    over = f" (over {len(offline_s)} runs)" if len(offline_s) > 1 else ""
    lines += [
        f"{'Offline duration (s):':<40} {sum(offline_s) / len(offline_s):<10.2f}",
        f"{'Offline output token throughput (tok/s):':<40} {offline_tok_s:<10.2f}",
        f"{'Server output token throughput (tok/s):':<40} {server_tok_s:<10.2f}",
        f"{'Ratio server / offline output tok/s:':<40} {server_tok_s / offline_tok_s:.3f}x{over}",
        "=" * 50,
    ]
    return "\n".join(lines)


def _notes(res: BenchResult, workload: Workload) -> None:
    if res.completed and res.total_output_tokens != workload.num_output_tokens:
        print(
            f"note: {res.total_output_tokens} tokens generated, the workload asks for "
            f"{workload.num_output_tokens}"
        )
    if res.prefix_cache_hits:
        print(
            "note: the server's prefix cache skipped the prefill of "
            f"{res.prefix_cache_hits} prompt tokens; another --seed gives prompts it has not seen"
        )


def _server_args(args: argparse.Namespace, model: str, setting: str, trace_db: Path) -> list[str]:
    out = ["--model", model, "--tp", str(args.tp), "--dtype", args.dtype]
    out += TRACING_SETTINGS[setting]
    if setting != "off":
        out += ["--trace-db", str(trace_db)]
    for flag, value in (
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-num-seqs", args.max_num_seqs),
    ):
        if value is not None:
            out += [flag, str(value)]
    return out


def _count_spans(trace_db: Path) -> int:
    import duckdb

    with duckdb.connect(str(trace_db), read_only=True) as con:
        return con.execute("SELECT count(*) FROM spans").fetchone()[0]


def compare_tracing(
    model: str,
    workload: Workload,
    settings: list[str],
    args: argparse.Namespace,
    offline: Callable[[int], None] | None = None,
) -> dict[str, list[BenchResult]]:
    """One fresh `stepscope serve` per tracing setting, the workload against each in turn.

    With `--repeat N` the order alternates (`alternating`). `offline(run)`, if given, takes its
    turn in that order as one more setting, while no server runs. Prints each run, then each
    setting's output tok/s over all its runs and its ratio to the first setting.
    """
    from stepscope.engine.entrypoints.serve import ServerProcess

    results: dict[str, list[BenchResult]] = {s: [] for s in settings}
    folder = Path(tempfile.mkdtemp(prefix="stepscope-bench-serve-"))
    order = settings + ["offline"] if offline else settings
    for rep, setting in alternating(order, args.repeat):
        if setting == "offline":
            offline(rep)
            continue
        trace_db = folder / f"{setting}-{rep}.duckdb"
        server = ServerProcess(*_server_args(args, model, setting, trace_db))
        try:
            res = run_bench_serve(
                server.url,
                workload,
                args.concurrency,
                args.request_rate,
                None,
                model,
                args.seed,
            )
        finally:
            server.stop()
        results[setting].append(res)
        spans = ""
        if setting != "off":
            spans = f", {_count_spans(trace_db)} spans in its trace file"
        print(_run_line(f"tracing {setting:<8} run {rep + 1}:", res) + spans, flush=True)
        _notes(res, workload)
    print(format_result(results[settings[0]][0]))
    base = settings[0]

    def tok_s(setting: str) -> float:
        runs = results[setting]
        return sum(r.total_output_tokens for r in runs) / sum(r.duration_s for r in runs)

    for setting in settings:
        line = f"tracing {setting}: {tok_s(setting):.1f} output tok/s over {args.repeat} run(s)"
        if setting != base:
            line += f"; ratio tracing {setting} / {base}: {tok_s(setting) / tok_s(base):.3f}x"
        print(line)
    return results
