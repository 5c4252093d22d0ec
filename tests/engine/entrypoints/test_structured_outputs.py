"""Structured outputs and tool calls on the OpenAI surface: requests into
`StructuredOutputsParams` (and their 400s), the tool-call parsers, and the chat response
builder's `tool_calls` and `finish_reason`, without a model; then the 400s and constrained
outputs through the shared tiny-llama server. Real clients on SmolLM2: test_structured_clients.py.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import ValidationError

from stepscope.engine.entrypoints.openai_responses import ChatResponses, Increment
from stepscope.engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from stepscope.engine.entrypoints.structured_outputs import engine_errors_named
from stepscope.engine.entrypoints.tool_parsers import (
    HermesToolParser,
    NamedCallParser,
    RequiredCallsParser,
    template_messages,
    template_renders_tools,
)
from stepscope.engine.sampling_params import FieldError, SamplingParams
from tests.server_utils import API_KEY, SERVED_MODEL

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["city"],
            "$defs": {"Unit": {"enum": ["c", "f"]}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": USER, **kw})


def refused(make, **kw) -> FieldError | ValidationError:
    """The error a request raises; its `param` is the 400's."""
    with pytest.raises((FieldError, ValidationError)) as info:
        make(**kw)
    return info.value


def param_of(e: FieldError | ValidationError) -> str:
    if isinstance(e, FieldError):
        return e.param
    err = e.errors()[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):
        return cause.param
    return ".".join(str(p) for p in err["loc"])


def so(request) -> object:
    return request.to_sampling_params().structured_outputs


# ---- requests into StructuredOutputsParams ------------------------------------------------------
def test_response_format_json_schema_becomes_the_schema_text() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    params = so(chat(response_format=rf))
    assert params.kind == "json" and json.loads(params.json) == schema
    assert so(chat(response_format={"type": "json_object"})).json_object
    assert so(chat(response_format={"type": "text"})) is None
    # Completions take it too, as vLLM's do.
    assert so(CompletionRequest(model="m", prompt="x", response_format=rf)).kind == "json"


def test_structured_outputs_and_guided_fields_map_to_the_same_params() -> None:
    schema = {"type": "object"}
    for given in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        assert json.loads(so(chat(**given)).json) == schema
    assert so(chat(structured_outputs={"regex": "[0-9]+"})).regex == "[0-9]+"
    assert so(chat(guided_regex="[0-9]+")).regex == "[0-9]+"
    assert so(chat(guided_choice=["yes", "no"])).choice == ["yes", "no"]
    assert so(CompletionRequest(model="m", prompt="x", guided_grammar='root ::= "a"')).grammar
    assert so(chat(structured_outputs={"json_object": True})).json_object


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
        ),
        (
            {
                "response_format": {"type": "json_object"},
                "tools": [WEATHER],
                "tool_choice": "required",
            },
            "tools",
        ),  # fmt: skip
    ],
)
def test_two_constraints_are_refused_naming_the_second(kw, param) -> None:
    assert param_of(refused(chat, **kw)) == param


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format.json_schema.schema",
        ),  # fmt: skip
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"best_of": 2}, "best_of"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"tools": []}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),  # fmt: skip
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
                ],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),  # fmt: skip
    ],
)
def test_bad_or_unsupported_fields_are_refused_by_name(kw, param) -> None:
    assert param_of(refused(chat, **kw)) == param


def test_fields_that_change_nothing_generated_are_accepted() -> None:
    r = chat(user="u", metadata={"k": "v"}, store=False, service_tier="auto",
             prompt_cache_key="p", safety_identifier="s", parallel_tool_calls=True)  # fmt: skip
    assert so(r) is None


def test_required_tool_choice_is_an_array_of_calls_with_defs_at_the_top() -> None:
    r = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(so(r).json)
    assert schema["maxItems"] == 1 and set(schema["$defs"]) == {"Unit"}
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = chat(tools=[TIME, WEATHER], tool_choice={"function": {"name": "get_weather"}})
    assert json.loads(so(named).json) == WEATHER["function"]["parameters"]
    assert named.constraint.param == "tools.1.function.parameters"
    assert chat(tools=[WEATHER]).effective_tool_choice == "auto"
    assert so(chat(tools=[WEATHER], tool_choice="none")) is None


def test_an_engine_error_about_the_grammar_names_the_requests_field() -> None:
    r = chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    with pytest.raises(FieldError) as info, engine_errors_named(r.constraint):
        raise FieldError("structured_outputs.json", "structured_outputs.json: unsupported")
    assert info.value.param == "response_format.json_schema.schema"
    assert str(info.value).startswith("response_format.json_schema.schema: ")


# ---- the parsers --------------------------------------------------------------------------------
def streamed(parser, pieces: list[str]) -> tuple[str, list[dict]]:
    content, calls = "", []
    for i, piece in enumerate(pieces):
        c, d = parser.stream(piece, i == len(pieces) - 1)
        content += c
        calls += d
    return content, calls


def test_named_call_streams_its_id_and_name_then_argument_fragments() -> None:
    content, deltas = streamed(NamedCallParser("f"), ['{"a"', ": 1", "}"])
    assert content == "" and [d["index"] for d in deltas] == [0, 0, 0]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "f"
    assert "id" not in deltas[1] and "".join(d["function"]["arguments"] for d in deltas) == (
        '{"a": 1}'
    )
    _, calls = NamedCallParser("f").extract('{"a": 1}')
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 1}


def test_required_calls_stream_each_call_whole_once_it_closes() -> None:
    text = '[{"name": "f", "parameters": {"a": "}"}}, {"name": "g", "parameters": {}}]'
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    content, deltas = streamed(RequiredCallsParser(), pieces)
    assert content == "" and [(d["index"], d["function"]["name"]) for d in deltas] == [
        (0, "f"),
        (1, "g"),
    ]
    assert json.loads(deltas[0]["function"]["arguments"]) == {"a": "}"}
    content, calls = RequiredCallsParser().extract(text[:20])  # cut short by max_tokens
    assert content == text[:20] and calls == []
    assert streamed(RequiredCallsParser(), [text[:8], text[8:20]]) == (text[:20], [])


def test_hermes_finds_calls_in_free_text_whole_and_streamed() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = HermesToolParser().extract(text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    # Split anywhere, even inside a tag: the same calls, and no tag in the content.
    for size in (1, 3, 7):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        content, deltas = streamed(HermesToolParser(), pieces)
        assert content.strip() == "Let me check." and "<" not in content
        assert [(d["index"], d["function"]["name"]) for d in deltas] == [
            (0, "get_weather"),
            (1, "get_time"),
        ]
    assert [c.name for c in HermesToolParser(max_calls=1).extract(text)[1]] == ["get_weather"]
    assert HermesToolParser().extract("no calls < here") == ("no calls < here", [])
    assert streamed(HermesToolParser(), ["a <tool", "_c"]) == ("a <tool_c", [])


def test_template_renders_tools_reads_the_templates_variables() -> None:
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_renders_tools(None)


# ---- the chat response builder ------------------------------------------------------------------
def increment(text: str, finish: str | None, first: bool = True) -> Increment:
    return Increment(0, 0, [1], None, text, [7] * max(len(text), 1), [], finish, first)


def test_chat_responses_return_tool_calls_and_finish_with_tool_calls() -> None:
    responses = ChatResponses(None, "m", SamplingParams(), lambda: NamedCallParser("f"))
    body, _ = responses.choice(increment('{"a": 1}', "stop"))
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] is None
    (call,) = body["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    # Cut short: still `length`, as OpenAI says.
    body, _ = responses.choice(increment('{"a"', "length"))
    assert body["finish_reason"] == "length"
    first, _ = responses.delta(increment('{"a"', None))
    last, _ = responses.delta(increment(": 1}", "stop", first=False))
    assert first["delta"]["role"] == "assistant" and first["delta"]["tool_calls"][0]["id"]
    assert "content" not in first["delta"] and last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": ": 1}"}}]


# ---- through the shared tiny-llama server (tests/engine/conftest.py) ----------------------------
def post(server, path: str, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": SERVED_MODEL, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"min_p": 0.1}, "min_p"),  # vLLM's, not implemented here: refused, not ignored
        ({"tools": [WEATHER]}, "tool_choice"),  # auto: this template renders no tools
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format.json_schema.schema",
        ),  # fmt: skip
        # Refused by the grammar compiler (xgrammar has no lookahead), named as the request did.
        ({"guided_regex": "(?=a)a"}, "guided_regex"),
    ],
)
def test_the_server_refuses_with_a_400_naming_the_field(server, body, param) -> None:
    r = post(server, "/v1/chat/completions", messages=USER, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if param == "min_p":
        assert "not supported" in error["message"]


def test_the_server_accepts_what_clients_send_that_changes_nothing(server) -> None:
    r = post(
        server, "/v1/chat/completions", messages=USER, user="u", store=False,
        metadata={"k": "v"}, service_tier="auto", parallel_tool_calls=True,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", prompt="Hi", user="u", suffix="!")
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


# tiny-llama's random weights write anything the grammar allows: schemas that leave it a choice
# of a few short outputs, so that each finishes well within max_tokens.
UNIT = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
UNIT_TOOL = {"type": "function", "function": {"name": "set_unit", "parameters": UNIT}}


def sse(r: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_constrained_outputs_match_whole_and_streamed(server) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT}}
    whole = post(server, "/v1/chat/completions", messages=USER, response_format=rf, max_tokens=32)
    choice = whole.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), UNIT)
    assert choice["finish_reason"] == "stop"
    streamed = post(server, "/v1/chat/completions", messages=USER, response_format=rf,
                    max_tokens=32, stream=True, temperature=1.0, seed=5)  # fmt: skip
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in sse(streamed))
    jsonschema.validate(json.loads(text), UNIT)
    r = post(server, "/v1/completions", prompt="Yes or no?", n=4, temperature=1.0, seed=1,
             structured_outputs={"choice": ["yes", "no"]})  # fmt: skip
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no"}


def test_named_and_required_tool_calls_whole_and_streamed(server) -> None:
    named = {"type": "function", "function": {"name": "set_unit"}}
    body = {"messages": USER, "tools": [WEATHER, UNIT_TOOL], "max_tokens": 64}
    choice = post(server, "/v1/chat/completions", tool_choice=named, **body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "set_unit"
    jsonschema.validate(json.loads(call["function"]["arguments"]), UNIT)

    chunks = sse(post(server, "/v1/chat/completions", tool_choice=named, stream=True, **body))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "set_unit"
    assert {d["index"] for d in deltas} == {0}
    jsonschema.validate(json.loads("".join(d["function"]["arguments"] for d in deltas)), UNIT)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    body = {**body, "tools": [UNIT_TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    choice = post(server, "/v1/chat/completions", **body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), UNIT)


def test_a_conversation_with_calls_renders_them_for_a_template_without_tools() -> None:
    called = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    r = ChatCompletionRequest(
        model="m",
        messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [called]},
                  {"role": "tool", "content": "18C", "tool_call_id": "call_1"}],
    )  # fmt: skip
    plain = template_messages(r.messages, renders_tools=False)
    assert json.loads(plain[1]["content"]) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]
    assert plain[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    rich = template_messages(r.messages, renders_tools=True)
    assert rich[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    bad = {"role": "assistant", "tool_calls": [{"function": "get_weather"}]}
    assert param_of(refused(chat, messages=[*USER, bad])).startswith("messages.1.tool_calls")
