"""`stepscope serve` across several API servers and several machines (two process trees on
127.0.0.1 stand in for two machines).

- `--api-server-count`: API servers share one port, every one reaches every engine core.
- Process counts by pid: TP=2, DP=4, A=4 with executor="mp" serves with vLLM's 17 processes
  (A + DP + N + 1); vLLM's launching process, the 18th, stays alive to watch them, as ours does.
- Head + headless: requests served on both ranks, every span in the head's DuckDB file, the
  headless tree's death seen within the bound engine/liveness.py sets, nothing left running on
  either side.
- A headless machine that never registers fails the head's start-up with a clear message."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import httpx
import openai
import psutil
import pytest

from stepscope.engine import liveness
from stepscope.engine.entrypoints.serve import wait_healthy
from stepscope.traces.backend.client import CollectorClient
from stepscope.traces.backend.store import TraceStore
from stepscope.traces.backend.workload import run_starts
from tests.process_tree import noticed_within, pid_alive, wait_pids_gone
from tests.server_utils import CLI, Server, free_port

pytestmark = pytest.mark.slow  # multi-process deployments, up to 17 processes each

MODEL = "tiny-llama"
SMALL = ["--model", MODEL, "--num-kv-blocks", "64", "--max-num-batched-tokens", "32"]
SERVING_ROLES = {"api", "dp_coordinator", "engine_core", "worker"}
# A DP rank on another machine is lost DP_RANK_TIMEOUT_S after its last report, seen at the
# coordinator's next check and published at once; the API servers read the publication.
RANK_LOST_WITHIN_S = noticed_within(
    liveness.DP_RANK_TIMEOUT_S,
    liveness.DP_RANK_CHECK_S,
    liveness.COORDINATOR_PUBLISH_S,
    liveness.ENGINE_PROCESS_POLL_S,
)
# A TP node on another machine is lost WORKER_NODE_TIMEOUT_S after its last heartbeat, seen at
# the idle executor's next look; its engine core fails, and the API server polls the core.
NODE_LOST_WITHIN_S = noticed_within(
    liveness.WORKER_NODE_TIMEOUT_S, liveness.IDLE_HEALTH_CHECK_S, liveness.ENGINE_PROCESS_POLL_S
)


def _processes(url: str) -> list[dict]:
    return httpx.get(f"{url}/processes", timeout=10).json()["data"]


async def _complete(url: str, n: int, max_tokens: int = 6) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    outs = await asyncio.gather(
        *(
            client.completions.create(
                model=MODEL,
                prompt=f"Request {i}: " + "w " * i,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for i in range(n)
        )
    )
    return [o.choices[0].text for o in outs]


def test_two_api_servers_share_the_port_and_reach_both_ranks(tmp_path) -> None:
    db = tmp_path / "a2.duckdb"
    server = Server(*SMALL, "--dp", "2", "--api-server-count", "2", "--trace-db", str(db))
    try:
        procs = _processes(server.url)
        roles = sorted(p["role"] for p in procs if p["role"] in SERVING_ROLES)
        assert roles == ["api", "api", "dp_coordinator", "engine_core", "engine_core",
                         "worker", "worker"]  # fmt: skip
        assert sorted(p["rank"] for p in procs if p["role"] == "api") == [0, 1]
        texts = asyncio.run(_complete(server.url, 16))
        assert len(texts) == 16 and all(texts)
        # Each API server answers /metrics for itself, with the engine's gauges per DP rank.
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'api_server="' in metrics and 'engine="1"' in metrics
        pids = [p["pid"] for p in procs]
    finally:
        server.stop()
    assert wait_pids_gone(pids) == []
    store = TraceStore(db, read_only=True)
    try:
        ranks = store.df("SELECT DISTINCT dp_rank FROM requests ORDER BY 1")["dp_rank"].tolist()
        runs = run_starts(store)  # two API servers' run spans, one run
        servers = store.df(
            "SELECT DISTINCT rank FROM spans WHERE service_name = 'stepscope.api' AND "
            "name = 'stepscope.request'"
        )["rank"].tolist()
    finally:
        store.close()
    assert ranks == [0, 1]
    assert len(runs) == 1
    assert set(servers) <= {0, 1} and servers  # the spans say which API server served


def test_tp2_dp4_with_four_api_servers_serves_with_17_processes() -> None:
    server = Server(*SMALL, "--tp", "2", "--dp", "4", "--api-server-count", "4", "--no-trace",
                    timeout=300)  # fmt: skip
    try:
        procs = _processes(server.url)
        serving = [p for p in procs if p["role"] in SERVING_ROLES]
        # A + DP + N + 1 = 4 + 4 + 8 + 1 serving processes (the launcher, the 18th, is not one).
        assert len({p["pid"] for p in serving}) == 17
        assert all(pid_alive(p["pid"]) for p in serving)
        workers = sorted((p["dp_rank"], p["rank"]) for p in serving if p["role"] == "worker")
        assert workers == [(d, t) for d in range(4) for t in range(2)]
        assert len(asyncio.run(_complete(server.url, 4, max_tokens=3))) == 4
    finally:
        server.stop()
    assert wait_pids_gone([p["pid"] for p in procs]) == []


def _start(process_tree, *args: str) -> subprocess.Popen:
    return process_tree.popen(
        [*CLI, "serve", *args], stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def _read_until(proc: subprocess.Popen, marker: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if marker in line:
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {marker!r} from {proc.args} (exit code {proc.poll()})")


def test_head_and_headless_serve_both_ranks_into_one_trace(tmp_path, process_tree) -> None:
    db = tmp_path / "two-machines.duckdb"
    port, rpc = free_port(), free_port()
    dist = ["--dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
            "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]  # fmt: skip
    head = _start(process_tree, *SMALL, *dist, "--port", str(port), "--trace-db", str(db))
    collector = _read_until(head, "(collector ").rsplit("(collector ", 1)[1].rstrip(")\n")
    headless = _start(process_tree, *SMALL, *dist, "--headless", "--data-parallel-start-rank",
                      "1", "--otlp-endpoint", collector)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, head, 180)
    procs = _processes(url)
    head_pids = [p.pid for p in psutil.Process(head.pid).children(recursive=True)] + [head.pid]
    remote = [p for p in procs if p["dp_rank"] == 1 and p["role"] in ("engine_core", "worker")]
    assert len(remote) == 2 and not {p["pid"] for p in remote} & set(head_pids)
    headless_pids = [p["pid"] for p in remote] + [headless.pid]

    texts = asyncio.run(_complete(url, 8))
    assert len(texts) == 8 and all(texts)
    # The headless side's spans reach the head's collector (batched, every 2 s): wait for them
    # before that side dies, as a live query of the one trace file.
    trace = CollectorClient(collector)
    deadline = time.monotonic() + 30
    while trace.query("SELECT count(*) AS n FROM steps WHERE dp_rank = 1")[0]["n"] == 0:
        assert time.monotonic() < deadline, "no span of the headless rank reached the head"
        time.sleep(0.5)

    # The other "machine" goes away at once: its launcher and engine cores, SIGKILLed.
    for pid in headless_pids:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed < RANK_LOST_WITHIN_S
        time.sleep(0.1)
    assert time.monotonic() - killed < RANK_LOST_WITHIN_S
    health = httpx.get(f"{url}/health", timeout=5).json()["error"]["message"]
    assert "DP rank 1" in health

    head.send_signal(signal.SIGINT)
    assert head.wait(60) == 0
    assert wait_pids_gone(head_pids + headless_pids) == []
    store = TraceStore(db, read_only=True)
    try:
        steps = store.df("SELECT dp_rank, count(*) AS n FROM steps GROUP BY 1 ORDER BY 1")
        served = store.df("SELECT DISTINCT dp_rank FROM requests ORDER BY 1")
        # The coordinator's publications: rank 1 went from up to lost, when its machine died.
        lost = store.df(
            "SELECT dp_rank, list(lost ORDER BY time_ns) AS flags, "
            "max(report_age_s) AS oldest FROM dp_loads GROUP BY 1 ORDER BY 1"
        )
    finally:
        store.close()
    assert steps["dp_rank"].tolist() == [0, 1] and (steps["n"] > 0).all()
    assert served["dp_rank"].tolist() == [0, 1]
    assert lost["dp_rank"].tolist() == [0, 1]
    assert not any(lost["flags"][0])
    flags = list(lost["flags"][1])
    assert not flags[0] and flags[-1] and flags == sorted(flags)  # up, then lost for good
    assert lost["oldest"][1] > 3.0


def test_a_headless_machine_that_never_registers_fails_the_head_clearly(process_tree) -> None:
    head = process_tree.run(
        [*CLI, "serve", *SMALL, "--dp", "2", "--data-parallel-size-local", "1",
         "--data-parallel-rpc-port", str(free_port()), "--engine-ready-timeout", "8",
         "--no-trace", "--port", str(free_port())],
        timeout=180,
    )  # fmt: skip
    assert head.returncode != 0
    assert "no engine core of DP ranks [1] registered" in head.stderr, head.stderr[-2000:]
    assert "--headless" in head.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--api-server-count", "0"], "--api-server-count must be at least 1"),
        (
            ["--dp", "2", "--data-parallel-size-local", "3"],
            "data_parallel_size_local must be in [0, 2]",
        ),
        (["--headless", "--dp", "2"], "--headless needs --data-parallel-size-local"),
        (
            [
                "--headless",
                "--dp",
                "2",
                "--data-parallel-size-local",
                "1",
                "--data-parallel-start-rank",
                "2",
            ],
            "do not fit in --dp 2",
        ),  # fmt: skip
        (["--data-parallel-start-rank", "1"], "is for --headless"),
        (["--nnodes", "2", "--tp", "2", "--dp", "2"], "one DP rank"),
        (["--nnodes", "2", "--tp", "3"], "must be a multiple of nnodes 2"),
        (["--nnodes", "2", "--tp", "2", "--node-rank", "1"], "add --headless"),
    ],
)
def test_bad_scale_out_arguments_exit_2_with_a_clear_message(args, message) -> None:
    out = subprocess.run(
        [*CLI, "serve", "--model", MODEL, "--no-trace", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("how", ["clean", "killed"])
def test_stopping_the_head_stops_the_headless_machine_too(process_tree, how) -> None:
    port, rpc = free_port(), free_port()
    dist = ["--dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
            "127.0.0.1", "--data-parallel-rpc-port", str(rpc), "--no-trace"]  # fmt: skip
    head = _start(process_tree, *SMALL, *dist, "--port", str(port))
    headless = process_tree.popen(
        [*CLI, "serve", *SMALL, *dist, "--headless", "--data-parallel-start-rank", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, head, 180)
    assert len(asyncio.run(_complete(url, 4))) == 4
    pids = [p["pid"] for p in _processes(url)] + [headless.pid]
    if how == "clean":
        head.send_signal(signal.SIGINT)
        assert head.wait(60) == 0
        # The head told every engine core, the remote one too, to shut down; the headless
        # launcher ends with its engine cores.
        assert headless.wait(30) == 0
    else:
        # The head machine dies at once (every process of its tree, SIGKILLed): nobody tells
        # the remote engine core anything. It notices the coordinator's silence and stops.
        head_tree = [head.pid, *(p.pid for p in psutil.Process(head.pid).children(True))]
        os.killpg(head.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert headless.wait(30) == 0
        assert time.monotonic() - killed < 15.0
        assert "no word from the head" in headless.stderr.read()
        assert wait_pids_gone(head_tree) == []
    assert "engine cores stopped" in headless.stdout.read()
    assert wait_pids_gone(pids) == []


def test_tp_across_two_machines_gives_the_tp1_text_and_fails_fast(process_tree) -> None:
    from stepscope.engine import LLM, SamplingParams

    prompts = ["Hello, my name is", "The capital of France is a city that"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=MODEL, num_kv_blocks=64, max_num_batched_tokens=32) as llm:
        expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    port, master = free_port(), free_port()
    tp = ["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
          str(master), "--no-trace"]  # fmt: skip
    head = _start(process_tree, *SMALL, *tp, "--node-rank", "0", "--port", str(port))
    node1 = _start(process_tree, *SMALL, *tp, "--node-rank", "1", "--headless")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, head, 180)
    procs = _processes(url)
    workers = {p["rank"]: p["pid"] for p in procs if p["role"] == "worker"}
    node1_pids = [c.pid for c in psutil.Process(node1.pid).children(recursive=True)]
    assert sorted(workers) == [0, 1] and workers[1] in node1_pids and workers[0] not in node1_pids

    async def complete() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        outs = [
            await client.completions.create(
                model=MODEL, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )  # fmt: skip
            for p in prompts
        ]
        return [o.choices[0].text for o in outs]

    assert asyncio.run(complete()) == expected

    # The second machine goes away while the engine is idle: seen by its missing heartbeat.
    for pid in [node1.pid, *node1_pids]:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed < NODE_LOST_WITHIN_S
        time.sleep(0.1)
    assert "node 1" in httpx.get(f"{url}/health", timeout=5).json()["error"]["message"]
    head.send_signal(signal.SIGINT)
    assert head.wait(60) == 0
    assert wait_pids_gone([p["pid"] for p in procs]) == []
