"""`stepscope bench hybrid-kv`: one KV pool with the hybrid manager on and off, on a tiny random
Gemma 3 (window 24, five sliding-window layers and one full-attention layer)."""

from __future__ import annotations

import re

import pytest

from stepscope.engine.bench.hybrid_kv import bench_hybrid_kv, pool_blocks
from stepscope.engine.entrypoints.cli import build_parser
from stepscope.engine.models.config import read_model_shape
from tests.engine.models.checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"), seed=3)


def test_the_same_bytes_are_more_blocks_of_one_groups_layers(gemma3) -> None:
    shape = read_model_shape(gemma3)  # six groups of one layer
    blocks = pool_blocks(shape, pool_requests=2, tokens=100, block_size=16)
    assert blocks == {True: 2 * 7, False: 2 * 7 * 6}


def test_a_model_of_one_attention_type_is_refused(tmp_path) -> None:
    shape = read_model_shape(build_checkpoint("llama3", tmp_path, seed=1))
    with pytest.raises(SystemExit, match="one KV cache group"):
        pool_blocks(shape, 2, 100, 16)


@pytest.mark.slow  # two engines, six requests each (about 10 s)
def test_the_window_runs_more_requests_at_once_in_the_same_pool(gemma3, capsys) -> None:
    args = build_parser().parse_args(
        ["bench", "hybrid-kv", "--model", str(gemma3), "--num-requests", "6",
         "--prompt-tokens", "120", "--output-tokens", "24", "--pool-requests", "2"]
    )  # fmt: skip
    bench_hybrid_kv(args)
    out = capsys.readouterr().out
    rows = {
        m[1]: (int(m[2]), int(m[3]))
        for m in re.finditer(r"^(hybrid|disabled) +(\d+) +(\d+) ", out, re.MULTILINE)
    }
    assert rows["disabled"] == (2 * 9, 2)  # 144 tokens: 9 blocks a request, two at once
    assert rows["hybrid"][0] == 2 * 9 * 6 and rows["hybrid"][1] > 2
    # Each sliding group's peak is what its window spans per request; the full group holds all.
    line = next(x for x in out.splitlines() if x.startswith("hybrid "))
    assert "(full)" in line and "(window 24)" in line
    assert re.search(r"ratio hybrid / disabled: [\d.]+x requests at once, [\d.]+x output", out)
