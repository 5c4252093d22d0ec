"""The served dashboard in a real browser (Debian's Chromium via Playwright): widgets render, the
sliders drive the real scheduler, every page reads a real trace file and a live collector, and
nothing is fetched from anywhere but 127.0.0.1. Screenshots land in test-artifacts/dashboard/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from stepscope.traces.backend.client import CollectorClient
from stepscope.traces.backend.collector_process import (
    start_collector_process,
    stop_collector_process,
)
from stepscope.traces.backend.source import CollectorSource
from stepscope.viz.dashboard import DASHBOARD_PORT_ENV, MOUNT_EXTENSION
from stepscope.viz.request_path import stage_occurrences
from stepscope.viz.simulator import GEMMA3_LAYERS, simulate_step
from tests.viz.conftest import free_port, wait_http
from tests.viz.trace_factory import record_workload

pytestmark = pytest.mark.slow  # Chromium, dashboard servers, a live collector

TIMEOUT_MS = 30_000
READOUTS = ("decode_tokens", "prefill_budget", "first_chunk", "num_chunks", "first_chunk_blocks")


def _host(url: str) -> str | None:
    """Where a request goes: `data:` stays in the page, `blob:` belongs to the page's origin."""
    parts = urlsplit(url)
    if parts.scheme == "data":
        return "127.0.0.1"
    if parts.scheme == "blob":
        return urlsplit(parts.path).hostname
    return parts.hostname


class Page:
    """A browser tab that records every request it makes (and every websocket it opens)."""

    def __init__(self, browser, url: str) -> None:
        self.page = browser.new_page(viewport={"width": 1500, "height": 2300})
        self.urls: list[str] = []
        self.page.on("request", lambda request: self.urls.append(request.url))
        self.page.on("websocket", lambda ws: self.urls.append(ws.url))
        self.page.goto(url)
        # The page is blank until the websocket delivers the widgets: wait for a readout.
        self.page.locator("#ro-decode_tokens").wait_for(timeout=TIMEOUT_MS)

    def tab(self, name: str) -> None:
        self.page.locator(".bk-tab", has_text=name).click()

    def text(self, element_id: str) -> str:
        return self.page.locator(f"#{element_id}").inner_text()

    def expect_text(self, element_id: str, text: str) -> None:
        from playwright.sync_api import expect

        expect(self.page.locator(f"#{element_id}")).to_have_text(text, timeout=TIMEOUT_MS)

    def screenshot(self, path) -> None:
        self.page.wait_for_timeout(600)  # let Bokeh finish drawing its canvases
        self.page.screenshot(path=str(path))

    def assert_only_local(self) -> None:
        assert self.urls, "the page made no requests at all?"
        outside = [u for u in self.urls if _host(u) != "127.0.0.1"]
        assert not outside, f"requests left 127.0.0.1: {outside}"

    def close(self) -> None:
        self.page.close()


def _session(browser, url: str) -> Iterator[Page]:
    page = Page(browser, url)
    yield page
    page.assert_only_local()
    page.close()


@pytest.fixture(scope="module")
def empty_page(browser, servers) -> Iterator[Page]:
    """One session of the dashboard with no trace (a page load costs seconds on 2 CPUs)."""
    yield from _session(browser, servers["empty"].url)


@pytest.fixture(scope="module")
def replay_page(browser, servers) -> Iterator[Page]:
    """One session of the dashboard replaying the trace file."""
    yield from _session(browser, servers["replay"].url)


def _expect_readouts(page: Page, running: int, prompt_len: int, free_blocks: int, **kw) -> None:
    expected = simulate_step(running, prompt_len, free_blocks, **kw)
    page.expect_text("ro-decode_tokens", str(expected.decode_tokens))
    for key in READOUTS:
        value = getattr(expected, key)
        page.expect_text(f"ro-{key}", "-" if value is None else str(value))


def _press(page: Page, slider: str, key: str, times: int) -> None:
    handle = page.page.locator(f".{slider} .noUi-handle")
    handle.focus()
    for _ in range(times):
        handle.press(key)


def test_simulator_sliders_drive_the_real_scheduler(empty_page, artifacts):
    page = empty_page
    _expect_readouts(page, 64, 3968, 64)  # the walkthrough's group A
    page.expect_text("ro-verdict", "admitted")

    _press(page, "sim-running", "ArrowRight", 3)
    _expect_readouts(page, 67, 3968, 64)
    _press(page, "sim-prompt", "ArrowLeft", 2)
    _expect_readouts(page, 67, 3966, 64)
    _press(page, "sim-free", "Home", 1)  # the slider's start: no free block at all
    _expect_readouts(page, 67, 3966, 0)
    page.expect_text("ro-verdict", "short by 31 blocks")
    _press(page, "sim-free", "ArrowRight", 5)
    _expect_readouts(page, 67, 3966, 5)
    page.expect_text("ro-verdict", "short by 26 blocks")

    page.page.locator(".bk-btn", has_text="Group B").click()
    _expect_readouts(page, 127, 1920, 16)
    page.expect_text("ro-verdict", "short by 14 blocks")
    max_seqs = page.page.locator(".sim-max-seqs input")
    max_seqs.fill("127")
    max_seqs.press("Enter")
    page.expect_text("ro-verdict", "blocked by max seqs")
    page.page.locator(".bk-btn", has_text="Small pool").click()
    _expect_readouts(page, 4, 480, 36, budget=128, block_size=16)
    assert not page.page.locator(".sim-kv-groups").is_visible()  # one KV cache group
    page.screenshot(artifacts / "simulator.png")

    # Gemma 3's layers: six KV cache groups, and a chart of the blocks each holds.
    page.page.locator(".bk-btn", has_text="Gemma 3 layers").click()
    gemma = dict(budget=256, block_size=32, layer_types=GEMMA3_LAYERS, sliding_window=512)
    _expect_readouts(page, 2, 2000, 800, **gemma)
    from playwright.sync_api import expect

    expect(page.page.locator(".sim-kv-groups canvas").first).to_be_visible(timeout=TIMEOUT_MS)
    expect(page.page.get_by_text("full attention: 10 blocks at step 0")).to_be_visible()
    page.page.locator(".sim-kv-groups").scroll_into_view_if_needed()
    page.screenshot(artifacts / "simulator-kv-groups.png")
    page.assert_only_local()


def test_pages_without_a_trace_say_how_to_get_one(empty_page, artifacts):
    page = empty_page
    page.expect_text("source-label", "no trace loaded")
    for tab, shot in (("Request path", "no-trace-request-path.png"),
                      ("Engine", "no-trace-engine.png")):  # fmt: skip
        page.tab(tab)
        hint = page.page.get_by_text("stepscope serve --trace-db run.duckdb").first
        hint.wait_for(timeout=TIMEOUT_MS)
        assert hint.is_visible()
        page.screenshot(artifacts / shot)
    page.assert_only_local()


def test_request_path_page_shows_ten_stages_of_a_real_request(
    replay_page, artifacts, traced_tp2_run
):
    info = traced_tp2_run.info
    page = replay_page
    page.tab("Request path")
    page.page.locator("#ro-req-id").wait_for(timeout=TIMEOUT_MS)
    for stage in range(1, 11):
        assert page.page.locator(f"#stage-{stage}").is_visible()
    select = page.page.locator(".path-request select")  # not the simulator's layer pattern
    rid = info["preempted_request"]
    options = select.locator("option").all_inner_texts()
    select.select_option(label=next(o for o in options if o.startswith(f"{rid} ")))
    page.expect_text("ro-req-id", rid)
    page.expect_text("ro-req-preempt", str(info["preempted_times"]))
    page.screenshot(artifacts / "request-path.png")
    page.assert_only_local()


def test_engine_page_replays_the_trace_and_opens_a_request(replay_page, artifacts, traced_tp2_run):
    info = traced_tp2_run.info
    page = replay_page
    page.expect_text("source-label", "replay of run.duckdb")
    page.tab("Engine")
    page.expect_text("ro-eng-requests", str(info["requests"]))
    page.expect_text("ro-eng-steps", str(info["steps"]))
    page.expect_text("ro-eng-preempt", str(info["preemptions"]))
    next_step = page.page.locator("button.next")
    for _ in range(3):
        next_step.click()
    from playwright.sync_api import expect

    expect(page.page.locator("#replay-step")).to_contain_text("step 3:", timeout=TIMEOUT_MS)
    assert not page.page.locator(".eng-kv-groups").is_visible()  # a one-group model's run
    page.screenshot(artifacts / "engine.png")

    row = page.page.locator(".request-table .tabulator-row").nth(2)
    request_id = row.locator(".tabulator-cell[tabulator-field='request_id']").inner_text()
    row.locator(".tabulator-cell[tabulator-field='prompt']").click()
    page.expect_text("ro-req-id", request_id.strip())  # the request path page, that request
    assert page.page.locator("#stage-10").is_visible()
    page.assert_only_local()


def test_whatif_page_slider_changes_the_predicted_numbers(replay_page, artifacts, source):
    from stepscope.traces.backend.compare import metric_text
    from stepscope.viz.whatif import load_trace

    loaded = load_trace(source)  # what the page predicts, computed here
    recorded = loaded.settings({})
    settings = {"max_num_batched_tokens": recorded.max_num_batched_tokens,
                "num_kv_blocks": recorded.num_kv_blocks}  # fmt: skip
    before = loaded.predict({}).table
    after = loaded.predict({**settings, "max_num_seqs": 1}).table
    four = loaded.predict({**settings, "max_num_seqs": 4}).table
    assert after["ttft_p90_s"] > before["ttft_p90_s"] and four["ttft_p90_s"] != after["ttft_p90_s"]
    page = replay_page
    page.tab("What if")
    page.expect_text("ro-wi-ttft-p90", metric_text("ttft_p90_s", before["ttft_p90_s"]))
    _press(page, "wi-seqs", "Home", 1)  # max_num_seqs 1: one request at a time
    page.expect_text("ro-wi-ttft-p90", metric_text("ttft_p90_s", after["ttft_p90_s"]))
    page.expect_text("ro-wi-throughput", metric_text("throughput_tok_s", after["throughput_tok_s"]))
    _press(page, "wi-seqs", "ArrowRight", 3)  # moves in quick succession: the last one counts
    page.expect_text("ro-wi-ttft-p90", metric_text("ttft_p90_s", four["ttft_p90_s"]))
    assert "max_num_seqs 4 (recorded" in page.text("wi-status")
    page.screenshot(artifacts / "whatif.png")
    page.assert_only_local()


# ---- live: the dashboard inside the collector process -----------------------------------------
class LiveCollector:
    """A collector process serving the dashboard from its own store, fed synthetic spans on
    demand (four processes' worth, through the real span helpers: tests/viz/trace_factory.py)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.info: dict[str, int] | None = None

    def send_workload(self) -> dict[str, int]:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if self.info is None:
            spans, self.info = record_workload()
            exporter = OTLPSpanExporter(endpoint=self.url + "/v1/traces")
            assert exporter.export(spans).name == "SUCCESS"
            exporter.shutdown()
            assert CollectorClient(self.url).flush()["flushed"]
        return self.info


@pytest.fixture(scope="module")
def live_collector(tmp_path_factory) -> Iterator[LiveCollector]:
    db = str(tmp_path_factory.mktemp("live") / "live.duckdb")
    previous = os.environ.get(DASHBOARD_PORT_ENV)
    os.environ[DASHBOARD_PORT_ENV] = str(free_port())  # the spawned collector reads it
    try:
        process, url = start_collector_process(db, extensions=[MOUNT_EXTENSION])
    finally:
        if previous is None:
            del os.environ[DASHBOARD_PORT_ENV]
        else:
            os.environ[DASHBOARD_PORT_ENV] = previous
    try:
        wait_http(url + "/dashboard")
        yield LiveCollector(url)
    finally:
        stop_collector_process(process)


def test_live_dashboard_in_the_collector_refreshes(live_collector, browser, artifacts):
    page = Page(browser, live_collector.url + "/dashboard")  # redirect to its Panel server
    assert "live" in page.text("source-label")
    page.tab("Engine")
    page.page.get_by_text("No steps or requests in this trace yet.").wait_for(timeout=TIMEOUT_MS)
    info = live_collector.send_workload()
    page.expect_text("ro-eng-requests", str(info["requests"]))  # the 1 s refresh found them
    page.expect_text("ro-eng-steps", str(info["steps"]))
    assert "updated" in page.text("source-label")
    page.screenshot(artifacts / "engine-live.png")
    page.assert_only_local()
    page.close()


def test_collector_source_reads_a_running_collector(live_collector):
    from stepscope.viz import app

    info = live_collector.send_workload()
    source = CollectorSource(live_collector.url)
    assert source.live
    frame = source.query("SELECT request_id, ttft_s, output_tokens FROM requests")
    assert len(frame) == info["requests"]
    assert frame["ttft_s"].dtype.kind == "f" and frame["request_id"].dtype.kind in "OU"
    request, occ = stage_occurrences(source, "req-03")
    assert set(occ["stage"]) == set(range(1, 11))
    assert request["output_tokens"] == 20
    engine = app.EnginePage(source, open_request=lambda rid: None)
    assert len(engine.table.value) == info["requests"]
    assert len(engine.step_source.data["step"]) == info["steps"]
