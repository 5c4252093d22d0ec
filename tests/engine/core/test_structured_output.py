"""Structured outputs in the engine (engine/core/structured_output.py), offline through `LLM` on
tiny-llama (random weights, SmolLM2's tokenizer): whatever the model would say, the grammar's
mask decides what it can say. Choice, regex and JSON schema outputs match; a grammar cut by
max_tokens finishes `length`; the mask holds in both sampling paths, through preemption, for n>1
and under async scheduling; a grammar that fails to compile ends its request, not the engine;
the wait for a compile is the queue reason `grammar` in the trace."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.sampling_params import FieldError, StructuredOutputsParams
from stepscope.engine.worker.sampler import Sampler, apply_grammar_bitmask
from stepscope.kernels.cpu.build import available as cpu_kernel_available
from stepscope.traces.backend.explain import explain
from stepscope.traces.backend.store import TraceStore

PROMPTS = ["Hello, my name is", "Pick a colour:", "1 2 3 4", "Once upon a time"]
COLOURS = ["red", "green", "blue", 'dark "violet"']
SCHEMA = {
    "type": "object",
    "properties": {
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "green"]},
        "ok": {"type": "boolean"},
    },
    "required": ["size", "colour", "ok"],
    "additionalProperties": False,
}


def structured(temperature: float = 1.0, max_tokens: int = 40, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=None if temperature == 0 else 5, max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-llama", num_kv_blocks=128, max_num_batched_tokens=64)


def test_choice_output_is_one_of_the_choices(llm: LLM) -> None:
    outs = llm.generate(PROMPTS * 2, structured(choice=COLOURS), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].text in COLOURS and out.outputs[0].finish_reason == "stop"


def test_regex_output_matches(llm: LLM) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for params in (structured(regex=pattern), structured(0.0, regex=pattern)):
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop"


def test_json_schema_output_validates(llm: LLM) -> None:
    params = structured(max_tokens=60, json=json.dumps(SCHEMA))
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        assert "  " not in out.outputs[0].text  # no unbounded whitespace


def test_length_bounded_strings_stay_json(llm: LLM) -> None:
    """xgrammar 0.2.8 compiles maxLength into a string that admits raw control characters: on
    this prompt tiny-llama wrote byte 0x1e inside the string and finished `stop` with text
    json.loads refused. Bounded strings compile as a pattern of plain characters instead."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 2, "maxLength": 12},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        },
        "required": ["city", "tags"],
        "additionalProperties": False,
    }
    prompts = ["Weather in Oslo as JSON:", *PROMPTS]
    for params in (structured(0.0, max_tokens=60, json=json.dumps(schema)),
                   structured(max_tokens=60, json=json.dumps(schema))):  # fmt: skip
        for out in llm.generate(prompts, params, use_tqdm=False):
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_a_bounded_string_with_a_pattern_is_refused_by_name() -> None:
    schema = {"type": "string", "maxLength": 5, "pattern": "^[a-z]+$"}
    with pytest.raises(FieldError, match="pattern or format") as refused:
        StructuredOutputsParams(json=json.dumps(schema)).check()
    assert refused.value.param == "structured_outputs.json"


def test_a_grammar_whose_error_xgrammar_cannot_decode_is_refused_by_name() -> None:
    # xgrammar's message quotes the grammar cut inside an "é": found by schemathesis as a 500.
    with pytest.raises(FieldError, match="invalid grammar") as refused:
        StructuredOutputsParams(grammar="root ::= " + "\u00e9" * 80).check()
    assert refused.value.param == "structured_outputs.grammar"


def test_json_object_output_parses_or_is_cut_by_length(llm: LLM) -> None:
    for out in llm.generate(PROMPTS, structured(max_tokens=30, json_object=True), use_tqdm=False):
        completion = out.outputs[0]
        assert completion.text.startswith("{")
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)


def test_grammar_cut_by_max_tokens_finishes_length(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], structured(max_tokens=3, json=json.dumps(SCHEMA)))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].text.startswith('{"')


def test_plain_requests_beside_structured_ones_are_unchanged(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, greedy, use_tqdm=False)
    mixed = llm.generate(
        PROMPTS + PROMPTS, [greedy] * 4 + [structured(choice=COLOURS)] * 4, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].text in COLOURS for o in mixed[4:])


def test_n_children_each_follow_the_grammar(llm: LLM) -> None:
    params = SamplingParams(
        n=4, temperature=1.0, max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=r"(yes|no|maybe)!"),
    )  # fmt: skip
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert all(c.text in ("yes!", "no!", "maybe!") for c in out.outputs)


def test_invalid_grammars_are_refused_before_the_engine(llm: LLM) -> None:
    cases = {
        "structured_outputs.json": {"json": "{not json"},
        "structured_outputs.regex": {"regex": "a("},
        "structured_outputs.grammar": {"grammar": "root ::= missing"},
    }
    for param, kind in cases.items():
        with pytest.raises(FieldError) as e:
            llm.generate(PROMPTS[0], structured(**kind), use_tqdm=False)
        assert e.value.param == param


def test_a_grammar_that_fails_to_compile_ends_its_request_not_the_engine(
    llm: LLM, monkeypatch
) -> None:
    # As from a front end that did not check: the engine core finds it when it compiles.
    monkeypatch.setattr(StructuredOutputsParams, "check", lambda self: None)
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], [structured(regex="a("), plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort" and outs[0].outputs[0].token_ids == []
    assert outs[1].outputs[0].finish_reason == "length"
    again = llm.generate(PROMPTS[0], structured(choice=COLOURS), use_tqdm=False)[0]
    assert again.outputs[0].text in COLOURS


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_the_mask_holds_in_both_sampling_paths(cpu_kernels: bool) -> None:
    if cpu_kernels and cpu_kernel_available() is not None:
        pytest.skip(f"the CPU kernels do not build here: {cpu_kernel_available()}")
    vocab, rows = 1000, 6
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 5
    allowed = [torch.randperm(vocab)[: 1 + 3 * i].tolist() for i in range(rows)]
    bits = torch.zeros(rows, vocab, dtype=torch.bool)
    for i, ids in enumerate(allowed):
        bits[i, ids] = True
    # Packed as xgrammar packs it: bit j of int32 word w is token 32 w + j; one word past vocab.
    padded = torch.nn.functional.pad(bits, (0, 32 * (vocab // 32 + 1) - vocab))
    weights = 1 << torch.arange(32, dtype=torch.int64)
    words = (padded.view(rows, -1, 32).long() * weights).sum(-1)
    bitmask = words.where(words < 2**31, words - 2**32).to(torch.int32)
    masked_rows = torch.tensor([0, 2, 3, 5])
    apply_grammar_bitmask(logits, bitmask[masked_rows], masked_rows)
    sampler = Sampler(torch.device("cpu"), seed=1, cpu_kernels=cpu_kernels)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t, k, p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 0.9), (1.5, 0, 0.5),
                        (1.0, 5, 1.0), (0.0, 0, 1.0)]
    ]  # fmt: skip
    for _ in range(20):
        out = sampler(logits.clone(), params, [None] * rows, [[1]] * rows, [1] * rows)
        for row in masked_rows.tolist():
            assert out.token_ids[row] in allowed[row]


def test_preempted_structured_requests_resume_their_grammar() -> None:
    # 7 blocks of 16 tokens for 4 requests that each grow to 3 blocks (SmolLM2's tokenizer
    # makes each digit a token): preemptions, then each recomputes and goes on where it was.
    llm = LLM(model="tiny-llama", num_kv_blocks=7, max_num_batched_tokens=64)
    try:
        pattern = r"[0-9]{28}\."
        params = structured(max_tokens=40, regex=pattern)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.get_stats()["num_preemptions"] > 0
        for out in outs:
            assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop"
    finally:
        llm.shutdown()


def test_structured_requests_under_async_scheduling() -> None:
    llm = LLM(model="tiny-llama", num_kv_blocks=128, async_scheduling=True)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        params = [greedy, structured(max_tokens=60, json=json.dumps(SCHEMA))] * 2
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for out in outs[1::2]:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs[::2])
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_structured_requests_across_data_parallel_ranks(tmp_path) -> None:
    """Each DP rank's engine core compiles and masks its own requests' grammars."""
    db = tmp_path / "dp.duckdb"
    with LLM(model="tiny-llama", num_kv_blocks=128, data_parallel_size=2, trace_db=db) as llm:
        params = [structured(choice=COLOURS), structured(max_tokens=60, json=json.dumps(SCHEMA))]
        outs = llm.generate(PROMPTS * 2, params * 4, use_tqdm=False)
    with TraceStore(db, read_only=True) as store:
        served = store.df("SELECT DISTINCT request_id, dp_rank FROM step_requests")
    assert set(served.dp_rank) == {0, 1}  # both ranks ran structured requests
    for choice, schema in zip(outs[::2], outs[1::2], strict=True):
        assert choice.outputs[0].text in COLOURS
        jsonschema.validate(json.loads(schema.outputs[0].text), SCHEMA)


def test_waiting_for_a_grammar_is_queue_reason_grammar(tmp_path) -> None:
    db = str(tmp_path / "grammar.duckdb")
    # A schema large enough that its compile outlasts a few steps of the plain requests.
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)},
           "required": ["p0"]}  # fmt: skip
    llm = LLM(model="tiny-llama", num_kv_blocks=128, trace_db=db)
    try:
        plain = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        params = [plain, plain, structured(max_tokens=4, json=json.dumps(big))]
        llm.generate(PROMPTS[:3], params, use_tqdm=False)
    finally:
        llm.shutdown()
    store = TraceStore(db, read_only=True)
    try:
        requests = store.df("SELECT request_id, grammar_ready_ns FROM requests")
        waited = requests[requests["grammar_ready_ns"].notna()]
        assert len(waited) == 1 and requests["grammar_ready_ns"].isna().sum() == 2
        result = explain(store, waited["request_id"].iloc[0])
        assert result["queue_reasons"].get("grammar", 0) > 0
        assert max(result["queue_reasons"], key=result["queue_reasons"].get) == "grammar"
        reasons = store.df("SELECT waiting_reason FROM steps")["waiting_reason"].tolist()
        assert "grammar" in reasons  # the plain requests ran while it compiled
    finally:
        store.close()


@pytest.mark.slow
def test_smollm2_answers_a_real_schema_in_valid_json() -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population_millions": {"type": "number", "minimum": 0},
            "landmarks": {
                "type": "array",
                "items": {"type": "string", "maxLength": 40},
                "minItems": 1,
                "maxItems": 3,
            },  # fmt: skip
        },
        "required": ["city", "country", "population_millions", "landmarks"],
        "additionalProperties": False,
    }
    llm = LLM(model="smollm2-135m-instruct", num_kv_blocks=256)
    try:
        questions = ["Tell me about Paris as JSON.", "Describe Tokyo in JSON."]
        prompts = [
            llm.processor.apply_chat_template([{"role": "user", "content": q}]) for q in questions
        ]
        params = SamplingParams(
            temperature=0.0, max_tokens=160,
            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
        )  # fmt: skip
        for out in llm.generate(prompts, params, use_tqdm=False):
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    finally:
        llm.shutdown()


def test_compile_threads_run_below_the_engine_cores_priority() -> None:
    """A compile must not take the forward's core at the same priority (see COMPILE_NICENESS)."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from stepscope.engine.core.structured_output import COMPILE_NICENESS, _lower_priority

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    with ThreadPoolExecutor(1, initializer=_lower_priority) as pool:
        lowered = pool.submit(nice).result()
    assert lowered == min(19, nice() + COMPILE_NICENESS)
