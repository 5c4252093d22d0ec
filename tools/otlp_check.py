"""The same spans in a real OTLP backend (`make otlp-check`): Arize Phoenix against the DuckDB file.

    python tools/otlp_check.py [--screenshot docs/img/phoenix-request.png] [--requests 4]

1. Phoenix is installed once, pinned, in its own virtual environment under the stepscope cache
   (`$STEPSCOPE_CACHE/phoenix-venv`, default `~/.cache/stepscope`): never in `make test`, never
   in the project's `.venv`. Its dependencies hold no torch.
2. `phoenix serve` starts on loopback with a fresh working directory in a temporary folder,
   telemetry and external resources off; beside it `stepscope serve --model tiny-llama
   --trace-db X --otlp-endpoint <phoenix>/v1/traces --trace-content`.
3. A few completion and chat requests, then SIGINT to the server, which flushes every process.
4. Phoenix's REST API (`/v1/projects/stepscope/spans`, paginated) must hold the same span ids as
   the DuckDB file; each request one trace (API and engine core), each step one trace (engine
   core and worker); no span whose parent is missing; OpenInference kinds and token counts that
   match what the server answered.

It prints one line with the counts and exits 1 on any mismatch. Every process it started (each in
its own process group) is killed on any failure. `--screenshot PATH` saves Phoenix's view of one
request's trace (headless Debian chromium through playwright).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from stepscope.engine.models.loader import cache_dir
from stepscope.traces import names as n
from stepscope.traces.backend.store import TraceStore
from stepscope.traces.process import PARENT_ENV, free_port

PHOENIX = "arize-phoenix==20.26.1"  # pinned: the REST API and the UI's routes are read below
MODEL = "tiny-llama"
MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0
INGEST_TIMEOUT_S = 60.0  # Phoenix inserts what it accepted in the background
PAGE_SIZE = 1000  # the REST API's largest page
PR_SET_PDEATHSIG = 1


class CheckFailed(Exception):
    pass


# ---- Phoenix, installed once ---------------------------------------------------------------------
def phoenix_venv() -> Path:
    return cache_dir() / "phoenix-venv"


def ensure_phoenix(venv: Path) -> Path:
    """The `phoenix` command of the cached environment, installing it on first use."""
    stamp = venv / f".installed-{PHOENIX}"
    if not stamp.exists():
        print(f"otlp-check: installing {PHOENIX} into {venv} (once)", flush=True)
        shutil.rmtree(venv, ignore_errors=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([*pip, "--upgrade", "pip"], check=True)
            subprocess.run([*pip, PHOENIX], check=True)
        except subprocess.CalledProcessError as e:
            raise CheckFailed(f"installing {PHOENIX} failed: {e}") from e
        site = next((venv / "lib").glob("python3*/site-packages"))
        heavy = [p.name for p in site.iterdir() if p.name in ("torch", "nvidia")]
        if heavy:  # a dependency change upstream: refuse rather than keep gigabytes of CUDA
            raise CheckFailed(f"{PHOENIX} pulled in {heavy}; pin its dependencies")
        stamp.touch()
    return venv / "bin" / "phoenix"


def phoenix_env(port: int, grpc_port: int, working_dir: Path) -> dict[str, str]:
    """Loopback, a fresh working directory, nothing fetched from or sent to the internet."""
    return {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),  # unused here, but it listens: keep it off 4317
        "PHOENIX_WORKING_DIR": str(working_dir),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
        "PHOENIX_ENABLE_MCP_SERVER": "false",
        "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
        "PHOENIX_AGENTS_DISABLE_BASH": "true",
        "PHOENIX_AGENTS_DISABLE_WEB_ACCESS": "true",
    }


# ---- processes: each in its own group, all killed on any failure ---------------------------------
def _die_with_parent() -> None:
    """In the child: SIGKILL once this script dies, even killed (Linux's parent-death signal)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def process_groups() -> Iterator[list[subprocess.Popen]]:
    """Processes started into the yielded list; whatever is left of them is killed on exit."""
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):  # the group is gone: it ended cleanly
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start(cmd: list[str], log: Path, env: dict[str, str], started: list) -> subprocess.Popen:
    """`cmd` in a new session (its own process group), output to `log`, noted in `started`."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    started.append(proc)
    return proc


def wait_up(
    name: str, health_url: str, proc: subprocess.Popen, timeout: float = STARTUP_TIMEOUT_S
) -> None:
    """Until `health_url` answers 200; a failure if the process exits or stays silent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckFailed(f"{name} exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(health_url, timeout=1).status_code == 200:
                return
        time.sleep(0.3)
    raise CheckFailed(f"{name} did not answer {health_url} within {timeout:.0f} s")


def stop(name: str, proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGINT, as Ctrl-C would send, then wait for the process to exit; its exit code."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"{name} still running {timeout:.0f} s after SIGINT") from e


# ---- the workload ------------------------------------------------------------------------------
async def send_requests(url: str, count: int) -> list[dict[str, Any]]:
    """`count` requests at once, completions and chats in turn; the server's answers."""

    async def one(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"Request {i}: which step served me?"}]
            response = await client.post(f"{url}/v1/chat/completions", json=body)
        else:
            body["prompt"] = f"Request {i}: the scheduler admits"
            response = await client.post(f"{url}/v1/completions", json=body)
        response.raise_for_status()
        return response.json()

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client, i) for i in range(count)))


def answer_text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# ---- reading both sides --------------------------------------------------------------------------
def duckdb_spans(path: Path) -> dict[str, dict[str, Any]]:
    """span id -> trace_id, parent, name, service and attributes, from the closed trace file."""
    columns = ("span_id", "trace_id", "parent_span_id", "name", "service_name", "attributes")
    store = TraceStore(path, read_only=True)
    try:
        rows = store.con.execute(f"select {', '.join(columns)} from spans").fetchall()
    finally:
        store.close()
    spans = {row[0]: dict(zip(columns, row, strict=True)) for row in rows}
    for span in spans.values():
        span["attributes"] = json.loads(span["attributes"])
    return spans


def phoenix_spans(url: str, project: str) -> list[dict[str, Any]]:
    """Every span of the project, page by page."""
    spans: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": PAGE_SIZE}
        if cursor:
            params["cursor"] = cursor
        response = httpx.get(f"{url}/v1/projects/{project}/spans", params=params, timeout=30)
        if response.status_code == 404:
            return []  # no span has arrived yet: the project does not exist
        response.raise_for_status()
        page = response.json()
        spans += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def wait_ingested(url: str, project: str, expected: int) -> list[dict[str, Any]]:
    """Phoenix's spans once it holds `expected` of them, or once the count stops growing."""
    deadline = time.monotonic() + INGEST_TIMEOUT_S
    spans, last_change, last_count = [], time.monotonic(), -1
    while time.monotonic() < deadline:
        spans = phoenix_spans(url, project)
        if len(spans) >= expected:
            return spans
        if len(spans) != last_count:
            last_change, last_count = time.monotonic(), len(spans)
        elif spans and time.monotonic() - last_change > 10:
            return spans  # stalled short: let the comparison say what is missing
        time.sleep(1)
    return spans


# ---- the comparison ----------------------------------------------------------------------------
def compare(
    ours: dict[str, dict[str, Any]], theirs: list[dict[str, Any]], answers: list[dict[str, Any]]
) -> tuple[list[str], dict[str, int]]:
    """What differs (empty when nothing does), and the counts for the closing line."""
    problems: list[str] = []
    by_id = {span["context"]["span_id"]: span for span in theirs}
    if len(by_id) != len(theirs):
        problems.append(f"phoenix holds {len(theirs) - len(by_id)} duplicate span ids")
    missing, extra = ours.keys() - by_id.keys(), by_id.keys() - ours.keys()
    if missing or extra:
        problems.append(f"{len(missing)} spans only in duckdb, {len(extra)} only in phoenix")
    for span_id in ours.keys() & by_id.keys():
        mine, phoenix = ours[span_id], by_id[span_id]
        if (phoenix["context"]["trace_id"], phoenix["parent_id"], phoenix["name"]) != (
            mine["trace_id"], mine["parent_span_id"], mine["name"],
        ):  # fmt: skip
            problems.append(f"span {span_id} differs: {phoenix['name']} vs {mine['name']}")
    orphans = sum(1 for s in theirs if s["parent_id"] and s["parent_id"] not in by_id)
    if orphans:
        problems.append(f"{orphans} phoenix spans name a parent phoenix does not hold")
    kinds = Counter(s["span_kind"] for s in theirs if s["name"] != n.REQUEST)
    if set(kinds) != {n.SPAN_KIND_CHAIN}:
        problems.append(f"span kinds other than requests: {dict(kinds)} (want CHAIN only)")

    # Requests: one trace each, from the API process into the engine core.
    traces: dict[str, set[str]] = {}
    for span in theirs:
        service = ours.get(span["context"]["span_id"], {}).get("service_name", "?")
        traces.setdefault(span["context"]["trace_id"], set()).add(service)
    requests = {s["attributes"][n.REQUEST_ID]: s for s in theirs if s["name"] == n.REQUEST}
    request_traces = {s["context"]["trace_id"] for s in requests.values()}
    if len(requests) != len(answers) or len(request_traces) != len(answers):
        problems.append(
            f"{len(answers)} requests sent, phoenix holds {len(requests)} request spans in "
            f"{len(request_traces)} traces"
        )
    for answer in answers:
        span = requests.get(f"{answer['id']}-0")
        if span is None:
            problems.append(f"no request span for {answer['id']}")
            continue
        problems += check_request(span, answer, traces[span["context"]["trace_id"]])

    # Steps: one trace each, from the engine core into the worker and back.
    step_traces = {s["context"]["trace_id"] for s in theirs if s["name"] == n.ENGINE_STEP}
    lonely = [t for t in step_traces if n.SERVICE_WORKER not in traces[t]]
    if not step_traces or lonely:
        problems.append(f"{len(lonely)} of {len(step_traces)} step traces reach no worker")
    counts = {
        "phoenix": len(theirs),
        "duckdb": len(ours),
        "requests": len(requests),
        "request_traces": len(request_traces),
        "step_traces": len(step_traces),
        "orphans": orphans,
    }
    return problems, counts


def check_request(span: dict[str, Any], answer: dict[str, Any], services: set[str]) -> list[str]:
    """One request span as Phoenix shows it against what the server answered."""
    problems = []
    rid, attributes, usage = answer["id"], span["attributes"], answer["usage"]
    if services != {n.SERVICE_API, n.SERVICE_ENGINE_CORE}:
        problems.append(f"{rid}: its trace spans {sorted(services)}, not the API and engine core")
    if span["span_kind"] != n.SPAN_KIND_LLM or span["parent_id"] is not None:
        problems.append(f"{rid}: span kind {span['span_kind']}, parent {span['parent_id']}")
    expected = {
        n.LLM_MODEL_NAME: MODEL,
        n.LLM_TOKEN_COUNT_PROMPT: usage["prompt_tokens"],
        n.LLM_TOKEN_COUNT_COMPLETION: usage["completion_tokens"],
        n.LLM_TOKEN_COUNT_TOTAL: usage["total_tokens"],
        n.OUTPUT_VALUE: answer_text(answer),
    }
    for key, value in expected.items():
        if attributes.get(key) != value:
            problems.append(f"{rid}: {key} = {attributes.get(key)!r}, the server said {value!r}")
    if not attributes.get(n.INPUT_VALUE):
        problems.append(f"{rid}: no {n.INPUT_VALUE} despite --trace-content")
    return problems


# ---- the picture ---------------------------------------------------------------------------------
def screenshot(url: str, span_id: str, path: Path) -> None:
    """Phoenix's trace view with the request span selected, as a PNG under 300 KB."""
    from playwright.sync_api import sync_playwright

    path.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            # Phoenix's own redirect: the project's trace view, this span selected.
            page.goto(f"{url}/redirects/spans/{span_id}", wait_until="networkidle")
            page.get_by_text(n.REQUEST).first.wait_for(timeout=30_000)
            page.wait_for_timeout(1500)  # let the panels settle
            page.screenshot(path=str(path))
        finally:
            browser.close()
    shrink_png(path)


def shrink_png(path: Path, limit: int = 300_000) -> None:
    """A UI screenshot has few colours: a 256-colour palette keeps it sharp and small."""
    if path.stat().st_size <= limit:
        return
    from PIL import Image

    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)


# ---- the run -----------------------------------------------------------------------------------
def run(num_requests: int, screenshot_path: Path | None) -> str:
    started_at = time.monotonic()
    phoenix = ensure_phoenix(phoenix_venv())
    with tempfile.TemporaryDirectory(prefix="stepscope-otlp-check-") as tmp, process_groups() as ps:
        tmp_dir = Path(tmp)
        phoenix_port, serve_port = free_port(), free_port()
        phoenix_url = f"http://127.0.0.1:{phoenix_port}"
        serve_url = f"http://127.0.0.1:{serve_port}"
        trace_db = tmp_dir / "serve.duckdb"
        logs = {"phoenix": tmp_dir / "phoenix.log", "serve": tmp_dir / "serve.log"}
        try:
            # Both start at once; no span leaves the server before the first request.
            phoenix_proc = start(
                [str(phoenix), "serve"],
                logs["phoenix"],
                phoenix_env(phoenix_port, free_port(), tmp_dir / "phoenix"),
                ps,
            )
            serve = start(
                [sys.executable, "-m", "stepscope.engine.entrypoints.cli", "serve",
                 "--model", MODEL, "--port", str(serve_port), "--trace-db", str(trace_db),
                 "--otlp-endpoint", f"{phoenix_url}/v1/traces", "--trace-content"],
                logs["serve"],
                {**os.environ, PARENT_ENV: str(os.getpid())},
                ps,
            )  # fmt: skip
            wait_up("phoenix serve", f"{phoenix_url}/healthz", phoenix_proc)
            wait_up("stepscope serve", f"{serve_url}/health", serve)
            answers = asyncio.run(send_requests(serve_url, num_requests))
            code = stop("stepscope serve", serve)  # it flushes every process's spans
            if code != 0:
                raise CheckFailed(f"stepscope serve exited with code {code} after SIGINT")
            ours = duckdb_spans(trace_db)
            theirs = wait_ingested(phoenix_url, n.PROJECT_NAME, len(ours))
            problems, counts = compare(ours, theirs, answers)
            if problems:
                raise CheckFailed("; ".join(problems[:10]))
            if screenshot_path is not None:
                request = next(s for s in theirs if s["name"] == n.REQUEST)
                screenshot(phoenix_url, request["context"]["span_id"], screenshot_path)
            stop("phoenix serve", phoenix_proc)
        except BaseException:
            for name, log in logs.items():
                if log.exists():
                    tail = log.read_text(errors="replace").splitlines()[-15:]
                    print(f"--- {name} log (last lines) ---", *tail, sep="\n", file=sys.stderr)
            raise
    return (
        f"otlp-check: phoenix {counts['phoenix']} spans = duckdb {counts['duckdb']} spans, "
        f"{counts['requests']} requests, {counts['request_traces']} traces "
        f"(+{counts['step_traces']} step traces), {counts['orphans']} orphan parents, "
        f"{time.monotonic() - started_at:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4, help="requests to send (default 4)")
    parser.add_argument(
        "--screenshot", type=Path, default=None, help="save Phoenix's view of one request here"
    )
    args = parser.parse_args(argv)
    try:
        print(run(args.requests, args.screenshot), flush=True)
    except CheckFailed as e:
        print(f"otlp-check: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
