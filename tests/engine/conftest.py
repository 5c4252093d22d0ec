"""Engine test fixtures: one real `stepscope serve` process shared by the server's tests
(entrypoints/test_server.py) and the serving benchmark's (bench/test_bench_serve.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server_utils import API_KEY, SERVED_MODEL, Server, served


@pytest.fixture(scope="package")
def server() -> Iterator[Server]:
    """tiny-llama on loopback behind an API key, with 256 KV blocks, a 512-token context, 64
    sequences and a nice API server. Started by the first test under tests/engine that asks for
    it, stopped after the last test of tests/engine; every process it started dies with it.

    Tests that read its counters take differences (before and after their own requests), and
    each bench test replays its own seeded workload: they share one server in any order."""
    with served(
        "--model", SERVED_MODEL, "--num-kv-blocks", "256", "--api-key", API_KEY,
        "--max-model-len", "512", "--max-num-seqs", "64", "--api-server-niceness", "10",
    ) as s:  # fmt: skip
        yield s
