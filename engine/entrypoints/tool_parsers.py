"""Tool calls in the API server: tools into the prompt (stage 1), calls out of the text (stage 10).

Into the prompt: a chat template that renders `tools` gets them (and the conversation's earlier
calls and answers) as it expects; one that cannot gets them as a system text, so that
`tool_choice` `required` or a named function, whose output the grammar holds to the tool-call
JSON, works on any model. Out of the text, one parser per choice, whole or streamed in OpenAI's
deltas (vLLM: vllm/entrypoints/openai/tool_parsers/):
- `NamedCallParser`: the output is the named function's arguments (the grammar made it so);
- `RequiredCallsParser`: the output is a JSON array of `{"name", "parameters"}` calls;
- `HermesToolParser`: `--tool-call-parser hermes` for `tool_choice: auto`, calls as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in free text (Qwen's, Hermes').
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.meta

TOOL_CALL_PARSERS = ("hermes",)  # `--tool-call-parser` choices


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=new_call_id)

    def message(self) -> dict[str, Any]:
        """The call in a message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# ---- into the prompt ----------------------------------------------------------------------------
def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (so it can show the model its tools)."""
    if not chat_template:
        return False
    try:
        ast = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def template_messages(messages: list[Any], renders_tools: bool) -> list[dict[str, Any]]:
    """`protocol.ChatMessage`s as a chat template takes them. A template that renders tools
    gets the calls with their arguments as objects (as vLLM passes them); one that cannot reads
    only `content`, so an assistant's calls are written into it as JSON."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [_call_for_template(c.model_dump(exclude_none=True)) for c in m.tool_calls]
            if renders_tools:
                d["tool_calls"] = calls
            else:
                text = json.dumps([c["function"] for c in calls], ensure_ascii=False)
                d["content"] = f"{d['content']}\n{text}".lstrip("\n")
        out.append(d)
    return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    # Text that is not JSON: the template shows it as it came.
    with contextlib.suppress(json.JSONDecodeError):
        function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def tools_as_system_text(
    messages: list[dict[str, Any]], tools: list[Any], choice: Any
) -> list[dict[str, Any]]:
    """`messages` with the tools described in the system message, for a template that cannot
    render them: the grammar fixes the output's shape, this tells the model what to put in."""
    listed = "\n".join(
        json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools
    )
    if isinstance(choice, str):
        ask = (
            'Answer with a JSON array of calls, each {"name": <function name>, '
            '"parameters": <its arguments>}.'
        )
    else:
        ask = f"Call {choice.function.name}: answer with its arguments as one JSON object."
    text = f"You can call these functions (name, description, parameters):\n{listed}\n{ask}"
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- out of the text ----------------------------------------------------------------------------
class ToolCallParser(ABC):
    """One choice's output: the whole text into content and calls, or the streamed text, one
    increment at a time, into content deltas and OpenAI's `tool_calls` deltas."""

    def __init__(self) -> None:
        self.num_calls = 0  # calls streamed so far

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """The content (None when there is none) and the calls of a whole output."""

    @abstractmethod
    def stream(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """What `delta` (the text the increment added) adds: content, and `tool_calls` deltas.
        `final`: the choice's last increment."""

    def _whole(self, call: FunctionCall) -> dict[str, Any]:
        """One streamed call in a single delta: its index, id, name and all its arguments."""
        body = {"index": self.num_calls, **call.message()}
        self.num_calls += 1
        return body


class NamedCallParser(ToolCallParser):
    """`tool_choice` naming a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.id = new_call_id()

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        return None, [FunctionCall(self.name, text, self.id)]

    def stream(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.num_calls == 0:  # the call's first delta: its id and name, then arguments
            self.num_calls = 1
            call = FunctionCall(self.name, delta, self.id).message()
            return "", [{"index": 0, **call}]
        if not delta:
            return "", []
        return "", [{"index": 0, "function": {"arguments": delta}}]


def _json_calls(text: str) -> list[FunctionCall] | None:
    """The calls of a `required` output, or None if it is not the whole array (cut short)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
    ):
        return None
    return [
        FunctionCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
        for c in calls
    ]


class RequiredCallsParser(ToolCallParser):
    """`tool_choice: required`: a JSON array of `{"name", "parameters"}`. Streamed, each call is
    sent whole once its object has closed; an output cut short is content, as text."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.pos = 0  # where the next array element may start
        self.decoder = json.JSONDecoder()

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        calls = _json_calls(text)
        return (text, []) if calls is None else (None, calls)

    def stream(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += delta
        found = []
        while True:
            start = self._next_element()
            if start is None:
                break
            try:
                call, end = self.decoder.raw_decode(self.buffer, start)
            except json.JSONDecodeError:
                break  # not closed yet
            self.pos = end
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                args = json.dumps(call.get("parameters", {}), ensure_ascii=False)
                found.append(self._whole(FunctionCall(call["name"], args)))
        if final and not found and self.num_calls == 0:
            return self.buffer, []  # cut short before its first call closed: the text
        return "", found

    def _next_element(self) -> int | None:
        """Past `[`, `,` and whitespace to the next `{`, if the buffer has got there."""
        i = self.pos
        while i < len(self.buffer) and self.buffer[i] in "[, \t\r\n":
            i += 1
        if i >= len(self.buffer) or self.buffer[i] != "{":
            return None
        self.pos = i
        return i


class HermesToolParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in free text (vLLM's
    `Hermes2ProToolParser`): the text before the first call is content. Streamed, content goes
    out as it comes (holding back what may be the start of a tag), and each call whole once its
    closing tag arrives (a call that is not JSON goes out as content, as it came). With
    `max_calls` (`parallel_tool_calls: false`), later calls are dropped."""

    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__()
        self.max_calls = max_calls
        self.buffer = ""
        self.in_call = False
        self.seen_call = False

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for closed, open_ in self.CALL.findall(text):
            call = _hermes_call(closed or open_)
            if call is None:
                return text, []  # not what a hermes model writes: the text as it is
            calls.append(call)
        content = text[: text.index(self.START)].strip()
        return content or None, calls[: self.max_calls]

    def stream(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.START)
                if at < 0:
                    keep = 0 if final else _partial_tag(self.buffer, self.START)
                    if not self.seen_call:  # text after a call is chatter: dropped, as whole
                        content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                if not self.seen_call:
                    content += self.buffer[:at]
                self.buffer, self.in_call = self.buffer[at + len(self.START) :], True
                self.seen_call = True
            end = self.buffer.find(self.END)
            if end < 0 and not final:
                break
            body = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(self.END) :]
            self.in_call = False
            call = _hermes_call(body)
            if call is None:
                content += f"{self.START}{body}"
            elif self.max_calls is None or self.num_calls < self.max_calls:
                calls.append(self._whole(call))
            if end < 0:
                break
        return content, calls


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _hermes_call(body: str) -> FunctionCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return FunctionCall(call["name"], arguments)
