"""`stepscope bench sampling` end to end on tiny-llama: a traced server, sampled streams, and the
sample / forward ratio read back from its trace."""

from __future__ import annotations

import re

import pytest

from tests.server_utils import CLI

pytestmark = pytest.mark.slow  # a traced server under sampled streams


def test_bench_sampling_prints_the_ratio_from_the_trace(process_tree) -> None:
    out = process_tree.run(
        [*CLI, "bench", "sampling", "--model", "tiny-llama", "--streams", "5",
         "--max-tokens", "6"],
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    tokens = re.search(r"(\d+) tokens in [\d.]+ s over (\d+) worker steps", out.stdout)
    assert tokens is not None and int(tokens.group(1)) == 5 * 6 and int(tokens.group(2)) >= 6
    assert re.search(r"sample / forward: \d+\.\d%", out.stdout), out.stdout
    assert re.search(
        r"sorted [\d.]+ ms, partial top-K [\d.]+ ms .* CPU kernel [\d.]+ ms", out.stdout
    ), out.stdout
