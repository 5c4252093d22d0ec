"""`stepscope dashboard`: the command line serves a trace file's dashboard over HTTP."""

from __future__ import annotations

import subprocess

from tests.server_utils import CLI
from tests.viz.conftest import ROOT, free_port, wait_http
from tests.viz.trace_factory import write_trace


def test_dashboard_command_serves_a_trace_file(process_tree, tmp_path):
    db = tmp_path / "run.duckdb"
    write_trace(str(db))
    port = free_port()
    log_path = tmp_path / "dashboard.log"
    with open(log_path, "w") as log:
        server = process_tree.popen(
            [*CLI, "dashboard", "--db", str(db), "--port", str(port)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/", 120.0, process=server)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}:\n{log_path.read_text()}") from None
    assert f"http://127.0.0.1:{port}/" in log_path.read_text()  # says where it serves
