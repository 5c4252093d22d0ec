"""Every process stepscope starts dies with its parent, whatever ends the parent: `stepscope
serve` (engine core, workers, collector) and `stepscope demo` (the server and all of its).

A parent stopped by SIGINT, SIGTERM or SIGHUP (alone or with its whole process group) is tested
in test_stopping.py, which also checks that the trace kept every span; here the parent is
killed outright and cannot stop anything itself."""

from __future__ import annotations

import signal
import subprocess

import psutil
import pytest

from stepscope.engine.entrypoints.serve import wait_healthy
from tests.server_utils import CLI, free_port

pytestmark = pytest.mark.slow  # process lifetimes: servers killed, their trees watched


def port_is_free(port: int) -> bool:
    """Nothing listens there any more. (Not "the port can be bound": the suite runs in
    parallel workers, and another test's client may meanwhile hold the port as the local end
    of a connection, which is no server of ours.)"""
    return not any(
        c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        for c in psutil.net_connections(kind="tcp")
    )


def test_serve_killed_takes_its_engine_workers_and_collector_with_it(tmp_path, process_tree):
    port = free_port()
    cmd = [*CLI, "serve", "--model", "tiny-llama",
           "--num-kv-blocks", "64", "--tp", "2", "--port", str(port)]  # fmt: skip
    serve = process_tree.popen(cmd, cwd=tmp_path)
    wait_healthy(f"http://127.0.0.1:{port}", serve, timeout=180)
    children = psutil.Process(serve.pid).children(recursive=True)
    commands = [" ".join(c.cmdline()) for c in children]
    # engine core, two workers (multiprocessing spawn children), the trace collector
    assert any("core_proc" in c for c in commands) and any("collector" in c for c in commands)
    assert len(children) >= 4, commands
    serve.send_signal(signal.SIGKILL)
    serve.wait(timeout=60)
    assert process_tree.wait_gone(timeout=15) == []
    assert port_is_free(port)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_demo_stops_its_server_on_every_signal(tmp_path, process_tree, signum) -> None:
    port, dashboard = free_port(), free_port()
    cmd = [*CLI, "demo", "--model", "tiny-llama",
           "--port", str(port), "--dashboard-port", str(dashboard)]  # fmt: skip
    demo = process_tree.popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    for line in demo.stdout:  # the workload ran; the demo now waits for the user
        if "The server keeps running" in line:
            break
    else:
        raise AssertionError(f"the demo ended early with {demo.wait()}")
    assert len(process_tree.alive()) >= 4  # demo, server, engine core, collector
    demo.send_signal(signum)
    demo.wait(timeout=90)
    assert process_tree.wait_gone(timeout=20) == []
    assert port_is_free(port) and port_is_free(dashboard)
