"""`make demo` end to end (on tiny-llama to keep it quick): server, collector and dashboard start,
the sample workload streams back, and the trace file is left behind."""

from __future__ import annotations

import sys

from stepscope.traces.backend.store import TraceStore
from tests.server_utils import free_port


def test_demo_serves_the_sample_workload_and_leaves_a_trace(tmp_path, process_tree) -> None:
    ports = ["--port", str(free_port()), "--dashboard-port", str(free_port())]
    cmd = [
        sys.executable,
        "-m",
        "stepscope.engine.entrypoints.cli",
        "demo",
        "--model",
        "tiny-llama",
        *ports,
    ]
    cmd.append("--no-wait")
    result = process_tree.run(cmd, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "6 concurrent streaming requests" in result.stdout
    traces = list((tmp_path / "runs").glob("demo-*.duckdb"))
    assert len(traces) == 1
    store = TraceStore(traces[0], read_only=True)
    try:
        assert len(store.df("select * from requests")) == 6
    finally:
        store.close()
