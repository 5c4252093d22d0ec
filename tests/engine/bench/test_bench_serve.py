"""`run_bench_serve` against a real `stepscope serve` process on loopback, in both load modes
(`server`: the shared server of tests/engine/conftest.py, which requires API_KEY)."""

from __future__ import annotations

import re
import subprocess

import pytest

from stepscope.engine.bench.offline import Workload, alternating, make_workload
from stepscope.engine.bench.serve_client import (
    BenchResult,
    LatencyStats,
    format_result,
    run_bench_serve,
)
from stepscope.engine.models.loader import load_config, resolve_model
from tests.server_utils import API_KEY, CLI


@pytest.fixture(scope="module")
def vocab() -> int:
    return load_config(resolve_model("tiny-llama"))["vocab_size"]


@pytest.fixture(scope="module")
def workload(vocab) -> Workload:
    return make_workload(8, (8, 32), (4, 16), vocab, seed=0)


def assert_sane(res: BenchResult, workload: Workload) -> None:
    assert res.completed == 8 and res.failed == 0, res.errors
    assert [r.output_tokens for r in res.requests] == workload.output_lens
    assert res.total_output_tokens == workload.num_output_tokens
    assert res.total_input_tokens == sum(len(p) for p in workload.prompts)
    assert res.duration_s > 0 and res.output_throughput > 0
    for stats in (res.ttft, res.tpot, res.itl, res.e2el):
        assert 0 < stats.median_ms <= stats.p99_ms
        assert stats.mean_ms > 0
    assert res.ttft.median_ms <= res.e2el.median_ms
    assert "Successful requests:" in format_result(res)


def test_closed_loop_streams_every_requested_token(server, workload) -> None:
    res = run_bench_serve(server.url, workload, concurrency=3, api_key=API_KEY)
    assert res.concurrency == 3 and res.request_rate is None
    assert_sane(res, workload)


def test_open_loop_poisson_arrivals_stream_every_requested_token(server, workload) -> None:
    res = run_bench_serve(server.url, workload, request_rate=20.0, seed=1, api_key=API_KEY)
    assert res.request_rate == 20.0
    assert_sane(res, workload)


def test_replayed_workload_reports_prefix_cache_hits(server, vocab) -> None:
    workload = make_workload(4, (40, 64), (2, 2), vocab, seed=3)
    first = run_bench_serve(server.url, workload, concurrency=4, api_key=API_KEY)
    again = run_bench_serve(server.url, workload, concurrency=4, api_key=API_KEY)
    assert first.prefix_cache_queries is not None and first.prefix_cache_hits == 0
    assert again.prefix_cache_hits >= 4 * 32  # at least the first two full blocks of each
    assert "Prefix cache hits" in format_result(again)


def test_failed_request_is_counted_not_raised(server, vocab) -> None:
    good = make_workload(2, (8, 16), (4, 4), vocab, seed=2)
    bad_prompt = [vocab + 5] * 8  # out of the vocabulary: HTTP 400
    workload = Workload([good.prompts[0], bad_prompt, good.prompts[1]], [4, 4, 4])
    res = run_bench_serve(server.url, workload, concurrency=2, api_key=API_KEY)
    assert res.completed == 2 and res.failed == 1
    assert not res.requests[1].success and "HTTP 400" in res.requests[1].error
    assert res.total_output_tokens == 8
    assert "failed x1: HTTP 400" in format_result(res)


def test_both_load_modes_at_once_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="either concurrency or request_rate"):
        run_bench_serve("http://127.0.0.1:1", Workload([[100]], [1]), 2, 1.0)


def test_latency_stats_of_nothing_are_zero() -> None:
    assert LatencyStats.of([]) == LatencyStats(0.0, 0.0, 0.0)


def _bench_cli(tree, *args: str) -> subprocess.CompletedProcess:
    cmd = [*CLI, "bench", "serve", *args]
    return tree.run(cmd, timeout=600)


SMALL_WORKLOAD = (
    "--model", "tiny-llama", "--num-requests", "6", "--min-prompt", "8", "--max-prompt", "40",
    "--min-output", "4", "--max-output", "12", "--concurrency", "3",
)  # fmt: skip


def offline_ratios(stdout: str) -> tuple[list[float], float]:
    """`--compare-offline`'s ratios: run by run, then over all runs."""
    runs = [float(r) for r in re.findall(r"run \d+: server .* output tok/s: (\d+\.\d+)x", stdout)]
    over = re.search(r"Ratio server / offline output tok/s:\s+(\d+\.\d+)x", stdout)
    assert over is not None, stdout
    return runs, float(over.group(1))


@pytest.mark.slow
def test_tracing_off_and_on_side_by_side_in_one_run(tmp_path, process_tree) -> None:
    """`--tracing off,on` starts a server per setting, replays the workload on each, and prints
    the ratio; the traced server's file holds its spans. `--compare-offline` runs the offline
    engine in turn, after both servers have stopped. (The order of `--repeat` runs is
    `alternating`'s, tested below without a server: each run costs a server start.)"""
    out = _bench_cli(
        process_tree, "--tracing", "off,on", "--repeat", "1", "--compare-offline", *SMALL_WORKLOAD
    )
    assert out.returncode == 0, out.stderr[-3000:]
    order = re.findall(r"^(tracing off|tracing on|offline float32)\s+run 1:", out.stdout, re.M)
    assert order == ["tracing off", "tracing on", "offline float32"], out.stdout
    runs, over = offline_ratios(out.stdout)
    assert len(runs) == 1 and runs[0] == over > 0
    runs = re.findall(r"tracing (off|on)\s+run (\d): .* failed (\d+)(.*)", out.stdout)
    assert [(s, r) for s, r, _, _ in runs] == [("off", "1"), ("on", "1")]
    assert all(failed == "0" for _, _, failed, _ in runs)
    for setting, _, _, tail in runs:
        spans = re.search(r"(\d+) spans in its trace file", tail)
        assert (spans is not None) == (setting == "on")
        if spans:  # 6 requests, their steps, crossings and worker steps
            assert int(spans.group(1)) > 6 * 4
    ratio = re.search(r"ratio tracing on / off: (\d+\.\d+)x", out.stdout)
    assert ratio is not None and float(ratio.group(1)) > 0, out.stdout


@pytest.mark.slow
def test_repeated_comparison_with_offline_alternates_and_empties_the_prefix_cache(
    server, process_tree
) -> None:
    """Against a running server, `--repeat 2 --compare-offline` runs server, offline, offline,
    server; the second replay finds nothing in the prefix cache, so both do the same work."""
    out = _bench_cli(
        process_tree, "--url", server.url, "--api-key", API_KEY, "--repeat", "2",
        "--compare-offline", *SMALL_WORKLOAD,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    order = re.findall(r"^(server|offline float32) run (\d):", out.stdout, re.M)
    assert order == [
        ("server", "1"), ("offline float32", "1"), ("offline float32", "2"), ("server", "2")
    ], out.stdout  # fmt: skip
    # (Earlier tests' prompts may share a first block with the first run's.)
    assert "prefix cache skipped" not in out.stdout.split("server run 2:")[1]
    runs, over = offline_ratios(out.stdout)
    # All tokens over all seconds, each side: a mediant of the runs' ratios, so between them.
    assert len(runs) == 2 and min(runs) - 2e-3 <= over <= max(runs) + 2e-3


def test_repeats_alternate_the_order_so_that_no_setting_always_runs_first() -> None:
    assert alternating(["off", "on"], 1) == [(0, "off"), (0, "on")]
    assert alternating(["off", "on"], 2) == [(0, "off"), (0, "on"), (1, "on"), (1, "off")]
    assert alternating(["off", "requests", "on"], 3) == [
        (0, "off"), (0, "requests"), (0, "on"),
        (1, "on"), (1, "requests"), (1, "off"),
        (2, "off"), (2, "requests"), (2, "on"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--repeat must be at least 1"):
        alternating(["off", "on"], 0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tracing", "off,on", "--url", "http://127.0.0.1:1"], "either --url"),
        ([], "either --url"),
        (["--tracing", "off,loud"], "--tracing takes distinct values"),
        (["--tracing", "on,on"], "--tracing takes distinct values"),
        (["--tracing", "off,on", "--repeat", "0"], "--repeat must be at least 1"),
    ],
)
def test_bad_bench_serve_arguments_are_clear_errors(process_tree, args, message) -> None:
    out = _bench_cli(process_tree, "--model", "tiny-llama", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_no_trace_refuses_trace_options() -> None:
    cmd = [*CLI, "serve", "--model", "tiny-llama",
           "--no-trace", "--trace-db", "x.duckdb"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--no-trace records nothing" in out.stderr, out.stderr


def test_ttft_counts_from_the_first_chunk_that_carries_text() -> None:
    """A server that streams an empty chunk at once and the first token 0.3 s later (as
    llama.cpp's does) has a TTFT of 0.3 s, not of its empty chunk."""
    import asyncio
    import json

    from aiohttp import web

    from stepscope.engine.bench.serve_client import CompletionStreams, stream_completion

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for text, delay in (("", 0.0), ("Hi", 0.3), (" there", 0.05)):
            await asyncio.sleep(delay)
            chunk = {"choices": [{"index": 0, "text": text}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            host, port = runner.addresses[0][:2]
            async with CompletionStreams(f"http://{host}:{port}") as streams:
                return await stream_completion(streams, "m", 0, [1, 2, 3], 2)
        finally:
            await runner.cleanup()

    res = asyncio.run(run())
    assert res.success and res.output_tokens == 2
    assert res.ttft_s >= 0.3 and len(res.itl_s) == 1
