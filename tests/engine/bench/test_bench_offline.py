"""`stepscope bench offline --dtype`: stepscope and transformers side by side in each dtype."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from stepscope.engine.bench import offline
from stepscope.engine.entrypoints.cli import build_parser
from tests.server_utils import CLI

SMALL = [
    "--model", "tiny-llama", "--num-requests", "3", "--min-prompt", "8", "--max-prompt", "24",
    "--min-output", "4", "--max-output", "6", "--hf-batch-size", "3",
]  # fmt: skip


@pytest.mark.slow
def test_each_dtype_gets_its_roofline_tok_s_and_ratio() -> None:
    # Without --force-dtype: where this CPU emulates bfloat16 (AVX2 only), a bfloat16 run takes
    # many minutes; the benchmark then says so and runs float32 alone.
    out = subprocess.run(
        [*CLI, "bench", "offline", *SMALL, "--dtype", "float32,bfloat16"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    ).stdout
    native = "bfloat16: skipped" not in out
    if not native:
        assert re.search(r"bfloat16: skipped: its matmul runs at [\d.]+ GFLOP/s, 0\.\d\dx", out)
    for dtype in ("float32", "bfloat16") if native else ("float32",):
        assert re.search(rf"matmul roofline: [\d.]+ GFLOP/s \(2048\^3 {dtype}\)", out), out
        assert re.search(rf"stepscope \(uni, {dtype}\):.* output tok/s  MFU \d+%", out), out
        assert re.search(rf"transformers \({dtype}\):.* output tok/s", out), out
        assert re.search(rf"ratio stepscope / transformers \({dtype}\): [\d.]+x", out), out
    summary = out.split("--- summary")[1]
    assert summary.count("ratio") == (2 if native else 1), summary


def test_an_emulated_dtype_is_skipped_with_its_measured_rate(monkeypatch, capsys) -> None:
    # As if bfloat16's matmul ran at a third of float32's rate: below the threshold, skipped.
    probe = {torch.float32: 90.0, torch.bfloat16: 30.0}
    monkeypatch.setattr(offline, "NATIVE_FRACTION", 0.5)
    monkeypatch.setattr(offline, "matmul_peak_gflops", lambda dtype, n, reps: probe[dtype])
    args = build_parser().parse_args(
        ["bench", "offline", *SMALL, "--dtype", "bfloat16", "--skip-transformers"]
    )
    offline.bench_offline(args)
    out = capsys.readouterr().out
    assert "bfloat16: skipped: its matmul runs at 30.0 GFLOP/s, 0.33x float32's 90.0" in out
    assert "stepscope (uni" not in out  # nothing ran in the skipped dtype


def test_unknown_dtype_is_refused_before_any_run() -> None:
    args = build_parser().parse_args(["bench", "offline", *SMALL, "--dtype", "float8"])
    with pytest.raises(SystemExit, match="unknown"):
        offline.bench_offline(args)


@pytest.mark.slow
def test_dp_sizes_run_side_by_side_with_throughput_and_ttft() -> None:
    out = subprocess.run(
        [*CLI, "bench", "offline", *SMALL, "--dp", "1,2", "--skip-transformers"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    ).stdout
    for dp in (1, 2):
        assert re.search(rf"stepscope \(uni, dp {dp}, float32\):.* TTFT p50 [\d.]+ s", out), out
    section = out.split("--- data parallelism")[1]
    assert re.search(r"uni, dp 2: +[\d.]+ output tok/s \([\d.]+x dp 1\), TTFT p50", section)
    assert re.search(r"steps per DP rank: \[\d+, \d+\]; torch threads per rank \d+", out), out


@pytest.mark.parametrize("spec", ["0", "1,two"])
def test_bad_dp_sizes_are_refused_before_any_run(spec: str) -> None:
    args = build_parser().parse_args(["bench", "offline", *SMALL, "--dp", spec])
    with pytest.raises(SystemExit, match="--dp"):
        offline.bench_offline(args)


@pytest.mark.parametrize("spec", ["maybe", "off,"])
def test_bad_async_scheduling_settings_are_refused_before_any_run(spec: str) -> None:
    args = build_parser().parse_args(["bench", "offline", *SMALL, "--async-scheduling", spec])
    with pytest.raises(SystemExit, match="--async-scheduling"):
        offline.bench_offline(args)
