"""Nothing is lost when a run stops, however it is stopped.

A terminal's Ctrl-C (SIGINT) and hang-up (SIGHUP) reach every process of the foreground process
group, not only `stepscope serve`; a process manager may send SIGTERM to the whole group too. Each
test starts an entry point in a process group of its own, lets clients finish their requests,
signals the group (`os.killpg`, as a terminal does) or the parent alone, and then, on the very
next line after the parent exits, opens the trace file and compares it with what the clients
received: every request is there with the output tokens the client got, the steps' scheduled
tokens add up to each request's prompt and output, every message sent across the API <-> engine
core boundary was also recorded as received, and the closing line says 0 spans were lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import duckdb
import httpx
import pytest

from stepscope.engine.entrypoints.serve import wait_healthy
from stepscope.traces.backend.store import TraceStore
from tests.server_utils import CLI, free_port

pytestmark = pytest.mark.slow  # signals to real servers and scripts, then every span read back

STOP_TIMEOUT_S = 120
PROMPTS = [f"Request {i}: " + "alpha beta gamma " * (2 + 2 * i) for i in range(6)]


def signal_run(proc: subprocess.Popen, signum: int, target: str) -> None:
    """`group`: the whole process group, as a terminal does; `parent`: the parent alone."""
    if target == "group":
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)


async def _complete_all(url: str) -> dict[str, dict]:
    async def one(client: httpx.AsyncClient, i: int) -> dict:
        body = {"model": "tiny-llama", "prompt": PROMPTS[i], "max_tokens": 6 + 2 * i,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        response = await client.post(f"{url}/v1/completions", json=body, timeout=180)
        assert response.status_code == 200, response.text
        return response.json()

    async with httpx.AsyncClient() as client:
        replies = await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))
    # The engine's request id is the response's, with the choice's index.
    return {f"{r['id']}-0": r["usage"] for r in replies}


def check_trace(db: str, expected: dict[str, dict]) -> None:
    """The trace holds every request with the client's token counts, and every step of it.

    `expected`: request id -> {"prompt_tokens", "completion_tokens"} as the client saw them.
    Opening the file here, right after the parent exited, also checks that it was closed.
    """
    con = duckdb.connect(db, read_only=True)
    try:
        rows = con.execute(
            "SELECT request_id, input_tokens, output_tokens, cached_tokens, num_preemptions "
            "FROM requests"
        ).fetchall()
        got = {r[0]: r[1:] for r in rows}
        assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
        scheduled = dict(
            con.execute(
                "SELECT request_id, sum(num_tokens) FROM step_requests GROUP BY request_id"
            ).fetchall()
        )
        for rid, usage in expected.items():
            prompt, output, cached, preemptions = got[rid]
            assert (prompt, output) == (usage["prompt_tokens"], usage["completion_tokens"]), rid
            assert preemptions == 0, rid
            # A prefill schedules the uncached prompt and samples the first token; each later
            # step feeds back one token. A lost step would leave the sum short.
            assert scheduled.get(rid) == prompt - (cached or 0) + output - 1, rid
        # Step indices of each rank run from 0 without a gap.
        for rank, count, last in con.execute(
            "SELECT dp_rank, count(DISTINCT step), max(step) FROM steps GROUP BY dp_rank"
        ).fetchall():
            assert count == last + 1, f"DP rank {rank}: {count} steps, last index {last}"
        # Every message across the API <-> engine core boundary was recorded at both ends.
        for boundary, sends, receives in con.execute(
            "SELECT boundary, count(*) FILTER (WHERE side = 'send'), "
            "count(*) FILTER (WHERE side = 'receive') FROM crossings "
            "WHERE boundary IN ('api->engine_core', 'engine_core->api') GROUP BY boundary"
        ).fetchall():
            assert sends == receives > 0, (boundary, sends, receives)
    finally:
        con.close()


def assert_closing_line(output: str) -> None:
    line = [x for x in output.splitlines() if x.startswith("stepscope: trace saved to")]
    assert line, output[-3000:]
    assert re.search(r"from \d+ processes, 0 lost$", line[-1]), line[-1]


SERVE_CASES = [
    # (extra serve arguments, signal, target): the cases a terminal and a process manager make.
    # Each signal and target is taken by the plain server (SIGHUP by --tp 2); each larger layout
    # is stopped one way, as each case costs a server start.
    ([], signal.SIGINT, "group"),
    ([], signal.SIGTERM, "group"),
    (["--tp", "2"], signal.SIGHUP, "group"),
    ([], signal.SIGTERM, "parent"),
    (["--dp", "2"], signal.SIGTERM, "parent"),
    (["--api-server-count", "2"], signal.SIGTERM, "group"),
    # Engine cores as Ray actors, on a local cluster the server starts and leaves nothing of.
    (["--dp", "2", "--data-parallel-backend", "ray"], signal.SIGINT, "group"),
    (["--dp", "2", "--data-parallel-backend", "ray"], signal.SIGTERM, "group"),
]


@pytest.mark.parametrize(
    ("extra", "signum", "target"),
    SERVE_CASES,
    ids=[f"{' '.join(e) or 'dp1'}-{s.name}-{t}" for e, s, t in SERVE_CASES],
)
def test_serve_stopped_by_a_signal_keeps_every_span(
    tmp_path, process_tree, extra, signum, target
) -> None:
    port, db = free_port(), str(tmp_path / "run.duckdb")
    cmd = [*CLI, "serve", "--model", "tiny-llama", "--port", str(port), "--trace-db", db,
           "--num-kv-blocks", "128", *extra]  # fmt: skip
    serve = process_tree.popen(
        cmd, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, serve, timeout=300)
    expected = asyncio.run(_complete_all(url))
    signal_run(serve, signum, target)
    output, _ = serve.communicate(timeout=STOP_TIMEOUT_S)
    check_trace(db, expected)
    assert_closing_line(output)
    assert process_tree.wait_gone(timeout=20) == []


def test_demo_stopped_by_ctrl_c_keeps_every_span(tmp_path, process_tree) -> None:
    """`make demo` end to end (on tiny-llama, to keep it quick): server, collector and dashboard
    start, the sample workload streams back, Ctrl-C stops it all and leaves one trace file."""
    ports = ["--port", str(free_port()), "--dashboard-port", str(free_port())]
    demo = process_tree.popen(
        [*CLI, "demo", "--model", "tiny-llama", *ports], cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = []
    for line in demo.stdout:
        seen.append(line)
        if "The server keeps running" in line:
            break
    else:
        raise AssertionError(f"the demo ended early with {demo.wait()}:\n{''.join(seen)}")
    assert "6 concurrent streaming requests" in "".join(seen), "".join(seen)
    os.killpg(demo.pid, signal.SIGINT)
    output, _ = demo.communicate(timeout=STOP_TIMEOUT_S)
    assert demo.returncode == 0, "".join(seen)[-3000:] + output[-3000:]
    (db,) = (tmp_path / "runs").glob("demo-*.duckdb")
    store = TraceStore(db, read_only=True)
    try:
        counts = store.df("SELECT request_id, output_tokens FROM requests")
    finally:
        store.close()
    counts = list(counts.itertuples(index=False, name=None))
    assert len(counts) == 6 and all(n > 0 for _, n in counts), counts
    check_trace(str(db), {rid: _usage_in(str(db), rid) for rid, _ in counts})
    assert_closing_line("".join(seen) + output)
    assert process_tree.wait_gone(timeout=20) == []


def _usage_in(db: str, request_id: str) -> dict[str, int]:
    """What the demo's client got, as the API process recorded it on the request span (the
    demo prints text, not token counts); the sums over the engine's steps must agree with it."""
    con = duckdb.connect(db, read_only=True)
    try:
        prompt, output = con.execute(
            "SELECT input_tokens, output_tokens FROM requests WHERE request_id = ?", [request_id]
        ).fetchone()
    finally:
        con.close()
    return {"prompt_tokens": prompt, "completion_tokens": output}


SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from stepscope.engine import LLM, SamplingParams

    layout = {"ray": {"data_parallel_size": 2, "data_parallel_backend": "ray"}}
    llm = LLM(model="tiny-llama", trace_db=sys.argv[1], num_kv_blocks=128,
              **layout.get(sys.argv[2], {"executor": sys.argv[2]}))
    prompts = json.loads(sys.argv[3])
    outs = llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True)
                  for i in range(len(prompts))], use_tqdm=False)
    print(json.dumps({o.request_id: {"prompt_tokens": len(o.prompt_token_ids),
                                     "completion_tokens": len(o.outputs[0].token_ids)}
                      for o in outs}), flush=True)
    time.sleep(600)  # a long-running script, stopped from outside
    """
)
# "ray": DP 2 on Ray actors, on a local cluster the script starts (and leaves nothing of).
SCRIPT_CASES = [
    ("uni", signal.SIGTERM),
    ("mp", signal.SIGINT),
    ("mp", signal.SIGHUP),
    ("ray", signal.SIGHUP),
]


@pytest.mark.parametrize(
    ("executor", "signum"), SCRIPT_CASES, ids=[f"{e}-{s.name}" for e, s in SCRIPT_CASES]
)
def test_a_script_using_llm_stopped_by_a_signal_keeps_every_span(
    tmp_path, process_tree, executor, signum
) -> None:
    db = str(tmp_path / "run.duckdb")
    script = process_tree.popen(
        [sys.executable, "-c", SCRIPT, db, executor, json.dumps(PROMPTS)], cwd=tmp_path,
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = script.stdout.readline()
    assert line, script.communicate(timeout=STOP_TIMEOUT_S)[1][-3000:]
    expected = json.loads(line)
    os.killpg(script.pid, signum)
    _, err = script.communicate(timeout=STOP_TIMEOUT_S)
    check_trace(db, expected)
    assert_closing_line(err)
    assert process_tree.wait_gone(timeout=20) == []
