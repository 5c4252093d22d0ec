"""The OpenInference attributes that make the spans read well in Phoenix: a span kind on every
span, the model and token counts on request spans, the project name on every resource, and the
prompt and generated text only when the user opts in (`trace_content`, `--trace-content`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stepscope.engine.core.scheduler import StepStats
from stepscope.engine.entrypoints.cli import build_parser
from stepscope.traces import crossing_spans as cs
from stepscope.traces import names as n
from stepscope.traces import setup
from stepscope.traces import spans as sp
from stepscope.traces.backend.store import TraceStore

MODEL = "tiny-llama"
PROMPTS = ["The scheduler admits", "Blocks of the KV cache"]
CHAT = [{"role": "user", "content": "Which step served me?"}]


class _Output:  # an EngineCoreOutput's shape
    def __init__(self, tokens: list[int], finish: str | None = None) -> None:
        self.new_token_ids = tokens
        self.events = {}
        self.finish_reason = finish
        self.num_cached_tokens = 0
        self.num_preemptions = 0


def _every_kind_of_span() -> None:
    """One span from each helper, as the engine's processes record them."""
    with sp.request_span("r0", model=MODEL, input_tokens=5) as request:
        crossing, carrier = cs.send_span(n.API_TO_ENGINE_CORE, "EngineCoreRequest", 10, 1)
        with crossing:
            pass
        with cs.receive_span(n.API_TO_ENGINE_CORE, "EngineCoreRequest", 10, 1, carrier):
            pass
        request.observe(_Output([1, 2, 3], finish="length"))
    with sp.step_span(StepStats(step=0), ["r0"], [5]):
        with sp.child_span(n.SCHEDULE):
            pass
        sp.ended_child_span(n.UPDATE, 1, 2)
        crossing, carrier = cs.send_span(n.ENGINE_CORE_TO_WORKER, "SchedulerOutput", 10, 1)
        with crossing:
            pass
        with sp.worker_step_span(0, 0, carrier), sp.child_span(n.FORWARD, {"extra": 1}):
            pass
    sp.dp_publish_span([[0, 1, 0]], [5], 1, 2)


def test_every_span_has_an_openinference_kind_and_the_resource_a_project():
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_ENGINE_CORE, exporters=[memory])
    _every_kind_of_span()
    setup.flush_tracing()
    spans = memory.get_finished_spans()
    kinds = {s.name: s.attributes[n.OPENINFERENCE_SPAN_KIND] for s in spans}
    assert set(kinds) == {
        n.REQUEST, n.SEND, n.RECEIVE, n.ENGINE_STEP, n.SCHEDULE, n.UPDATE, n.WORKER_STEP,
        n.FORWARD, n.DP_PUBLISH,
    }  # fmt: skip
    assert kinds.pop(n.REQUEST) == n.SPAN_KIND_LLM
    assert set(kinds.values()) == {n.SPAN_KIND_CHAIN}
    forward = next(s for s in spans if s.name == n.FORWARD)
    assert forward.attributes["extra"] == 1  # a child's own attributes are kept
    for span in spans:
        assert span.resource.attributes[n.OPENINFERENCE_PROJECT_NAME] == n.PROJECT_NAME


def test_request_span_counts_tokens_under_both_conventions():
    memory = InMemorySpanExporter()
    setup.init_tracing(n.SERVICE_API, exporters=[memory])
    with sp.request_span("counted", model=MODEL, input_tokens=7) as request:
        request.observe(_Output([1, 2]))
        request.observe(_Output([3], finish="stop"))
    with sp.request_span("finished", model=MODEL, input_tokens=7) as request:
        request.finish(input_tokens=9, output_tokens=4)
    setup.flush_tracing()
    counted, finished = memory.get_finished_spans()
    assert counted.attributes[n.LLM_MODEL_NAME] == counted.attributes[n.GEN_AI_REQUEST_MODEL]
    assert _counts(counted.attributes) == (7, 3, 10)
    assert _counts(finished.attributes) == (9, 4, 13)
    for span in (counted, finished):
        assert n.INPUT_VALUE not in span.attributes and n.OUTPUT_VALUE not in span.attributes


def _counts(attributes) -> tuple[int, int, int]:
    """(prompt, completion, total) tokens, after checking they equal the GenAI usage."""
    prompt = attributes[n.LLM_TOKEN_COUNT_PROMPT]
    completion = attributes[n.LLM_TOKEN_COUNT_COMPLETION]
    assert prompt == attributes[n.GEN_AI_USAGE_INPUT_TOKENS]
    assert completion == attributes[n.GEN_AI_USAGE_OUTPUT_TOKENS]
    assert attributes[n.LLM_TOKEN_COUNT_TOTAL] == prompt + completion
    return prompt, completion, attributes[n.LLM_TOKEN_COUNT_TOTAL]


def test_serve_takes_trace_content_and_leaves_it_off_by_default():
    parser = build_parser()
    assert parser.parse_args(["serve"]).trace_content is False
    assert parser.parse_args(["serve", "--trace-content"]).trace_content is True


# ---- the offline LLM, in process, into a real DuckDB file ---------------------------------------
def _record(path: Path, trace_content: bool) -> list[str]:
    """tiny-llama's spans for PROMPTS and CHAT in `path`; the texts it generated, in order."""
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(model=MODEL, num_kv_blocks=32, trace_db=path, trace_content=trace_content) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        outputs += llm.chat(CHAT, params, use_tqdm=False)
    return [out.outputs[0].text for out in outputs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, tuple[list[dict], list[str]]]:
    """trace_content -> (every span as a row, the generated texts)."""
    runs = {}
    for trace_content in (False, True):
        path = tmp_path_factory.mktemp("openinference") / f"content-{trace_content}.duckdb"
        texts = _record(path, trace_content)
        store = TraceStore(path, read_only=True)
        try:
            rows = store.df("select name, attributes, resource from spans").to_dict("records")
        finally:
            store.close()
        for row in rows:
            row["attributes"] = json.loads(row["attributes"])
            row["resource"] = json.loads(row["resource"])
        runs[trace_content] = rows, texts
    yield runs
    setup.shutdown_tracing()


@pytest.mark.parametrize("trace_content", [False, True])
def test_request_spans_of_a_real_run_are_llm_spans_with_token_counts(runs, trace_content):
    rows, _ = runs[trace_content]
    requests = [row["attributes"] for row in rows if row["name"] == n.REQUEST]
    assert len(requests) == len(PROMPTS) + 1
    for attributes in requests:
        assert attributes[n.OPENINFERENCE_SPAN_KIND] == n.SPAN_KIND_LLM
        assert attributes[n.LLM_MODEL_NAME] == MODEL
        assert _counts(attributes)[1] == 4
    others = {row["attributes"].get(n.OPENINFERENCE_SPAN_KIND) for row in rows} - {n.SPAN_KIND_LLM}
    assert others == {n.SPAN_KIND_CHAIN}  # steps and their phases, worker steps: never missing
    assert {row["resource"][n.OPENINFERENCE_PROJECT_NAME] for row in rows} == {n.PROJECT_NAME}


def test_prompt_and_output_text_are_on_request_spans_only_with_trace_content(runs):
    content_keys = {n.INPUT_VALUE, n.INPUT_MIME_TYPE, n.OUTPUT_VALUE, n.OUTPUT_MIME_TYPE}
    rows, _ = runs[False]
    assert not any(content_keys & set(row["attributes"]) for row in rows)

    rows, texts = runs[True]
    requests = [row["attributes"] for row in rows if row["name"] == n.REQUEST]
    requests.sort(key=lambda attributes: int(attributes[n.REQUEST_ID]))
    assert [a[n.INPUT_VALUE] for a in requests[: len(PROMPTS)]] == PROMPTS
    assert CHAT[0]["content"] in requests[-1][n.INPUT_VALUE]  # the chat after its template
    assert [a[n.OUTPUT_VALUE] for a in requests] == texts
    for attributes in requests:
        assert attributes[n.INPUT_MIME_TYPE] == attributes[n.OUTPUT_MIME_TYPE] == n.MIME_TYPE_TEXT
    others = [row["attributes"] for row in rows if row["name"] != n.REQUEST]
    assert not any(content_keys & set(attributes) for attributes in others)
