"""Structured outputs and tool calls through real clients against a live SmolLM2 server: the
OpenAI SDK's `chat.completions.parse` on a pydantic model, LangChain's `with_structured_output`
and a tool call through its `bind_tools` (issue 41, item 4). Slow tier: one server for the
module, and few requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.server_utils import Server, served

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ASK = "Describe a fictional city: its name, its country and its population."


class City(BaseModel):
    """A city, with fields short enough that a 135M model closes them well within the limit."""

    name: str = Field(max_length=24)
    country: Literal["France", "Germany", "Italy", "Spain"]
    population: int = Field(ge=0, le=10**8)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with served("--model", MODEL, "--num-kv-blocks", "128", "--no-trace", timeout=300) as s:
        yield s


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def chat_model(server) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=0,
        max_tokens=96, max_retries=0,
    )  # fmt: skip


def test_openai_sdk_parse_returns_the_pydantic_model(client) -> None:
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        response_format=City,
        max_tokens=96,
        temperature=0,
    )
    message = r.choices[0].message
    assert isinstance(message.parsed, City), message.content
    jsonschema.validate(json.loads(message.content), City.model_json_schema())
    assert r.choices[0].finish_reason == "stop"


def test_langchain_with_structured_output_returns_the_model(chat_model) -> None:
    city = chat_model.with_structured_output(City).invoke(ASK)
    assert isinstance(city, City)


def test_langchain_bind_tools_named_and_required(chat_model) -> None:
    named = chat_model.bind_tools([City], tool_choice="City").invoke(ASK)
    (call,) = named.tool_calls
    assert call["name"] == "City" and call["id"].startswith("call_")
    City.model_validate(call["args"])
    assert named.response_metadata["finish_reason"] == "tool_calls"
    # Streamed, `required` (one call): the chunks add up to the call.
    bound = chat_model.bind_tools([City], tool_choice="required", parallel_tool_calls=False)
    chunks = list(bound.stream(ASK))
    whole = sum(chunks[1:], chunks[0])
    assert isinstance(whole, AIMessageChunk) and whole.tool_calls, whole
    (call,) = whole.tool_calls
    assert call["name"] == "City"
    City.model_validate(call["args"])
