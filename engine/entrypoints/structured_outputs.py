"""What the output must match, from the request (stage 1): `response_format`, vLLM's
`structured_outputs` and older `guided_*` fields, and `tools` with `tool_choice`.

The API server only turns these into one `StructuredOutputsParams` (a JSON schema as text, any
JSON object, a regex, a choice or an EBNF grammar); the engine core compiles it and the worker
masks the logits with it (vLLM: `ChatCompletionRequest.to_sampling_params` and
`_get_json_schema_from_tool`). A request gives at most one constraint: two are a 400 naming the
second. A schema that is not a JSON schema is refused here, before it reaches the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stepscope.engine.sampling_params import FieldError, StructuredOutputsParams


class _Strict(BaseModel):
    # A field we do not know would change the output: refused by name (a 400), never ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`. `strict` is accepted either way: the grammar
    always holds the output to the schema (as vLLM does)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` extra field: exactly one of these. vLLM's other keys
    (`structural_tag`, `whitespace_pattern`, ...) are refused as unknown fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted either way, as `json_schema.strict`


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class Constraint:
    """One request's constraint: what the engine gets, and the request field it came from
    (the `param` of a 400 the engine raises about it)."""

    def __init__(self, param: str, params: StructuredOutputsParams) -> None:
        self.param, self.params = param, params


def schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or its JSON text) as the engine takes it: its text, after
    checking that it is a JSON schema at all."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise FieldError(param, f"{param}: not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise FieldError(param, f"{param}: a JSON schema must be an object")
    # Imported at the first schema: importing jsonschema takes 1.5 s of CPU where its optional
    # IRI-format package is installed, too much for every API server's start.
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise FieldError(param, f"{param}: not a valid JSON schema: {e.message}") from None
    return json.dumps(schema, ensure_ascii=False)


def _json_schema(param: str, schema: Any) -> Constraint:
    return Constraint(param, StructuredOutputsParams(json=schema_text(schema, param)))


def _regex(pattern: str, param: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise FieldError(param, f"{param}: not a valid regular expression: {e}") from None
    return pattern


def _from_structured_outputs(so: StructuredOutputsRequest, prefix: str) -> list[Constraint]:
    """`structured_outputs` (prefix `structured_outputs.`) or the `guided_*` fields."""
    found = []
    if so.json_ is not None:
        param = f"{prefix}json"
        found.append(_json_schema(param, so.json_))
    if so.json_object:
        found.append(Constraint(f"{prefix}json_object", StructuredOutputsParams(json_object=True)))
    if so.regex is not None:
        param = f"{prefix}regex"
        found.append(Constraint(param, StructuredOutputsParams(regex=_regex(so.regex, param))))
    if so.choice is not None:
        param = f"{prefix}choice"
        if not so.choice or not all(so.choice):
            raise FieldError(param, f"{param}: must be a list of non-empty strings")
        found.append(Constraint(param, StructuredOutputsParams(choice=list(so.choice))))
    if so.grammar is not None:
        param = f"{prefix}grammar"
        if not so.grammar.strip():
            raise FieldError(param, f"{param}: an empty grammar")
        found.append(Constraint(param, StructuredOutputsParams(grammar=so.grammar)))
    return found


def _from_response_format(rf: ResponseFormat) -> list[Constraint]:
    if rf.type == "json_object":
        return [Constraint("response_format", StructuredOutputsParams(json_object=True))]
    if rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise FieldError(param, "response_format of type json_schema needs json_schema.schema")
        return [_json_schema(param, rf.json_schema.schema_)]
    return []  # text: free text


def constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsRequest | None,
    guided: dict[str, Any],
    tools: Constraint | None = None,
) -> Constraint | None:
    """The request's one constraint, or None for free text. `guided`: vLLM's older fields by
    name (`guided_json`, ...), mapped as vLLM mapped them onto `structured_outputs`; `tools`:
    the constraint of `tool_choice` required or named."""
    found = []
    if response_format is not None:
        found += _from_response_format(response_format)
    if structured_outputs is not None:
        found += _from_structured_outputs(structured_outputs, "structured_outputs.")
    given = {k.removeprefix("guided_"): v for k, v in guided.items() if v is not None}
    if given:
        found += _from_structured_outputs(StructuredOutputsRequest(**given), "guided_")
    if tools is not None:
        found.append(tools)
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise FieldError(
            found[1].param, f"only one constraint on the output per request; got {names}"
        )
    return found[0] if found else None


@contextmanager
def engine_errors_named(c: Constraint | None) -> Iterator[None]:
    """A 400 the engine raises about `structured_outputs` (a schema feature or grammar it
    cannot compile) names the request's own field instead."""
    try:
        yield
    except FieldError as e:
        if c is None or not e.param.startswith("structured_outputs"):
            raise
        raise FieldError(c.param, str(e).replace(e.param, c.param, 1)) from e


# ---- tool_choice: required or a named function ------------------------------------------------
def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(
    tools: list[Tool], choice: ToolChoice, parallel_tool_calls: bool | None
) -> Constraint | None:
    """`required`: a JSON array of calls, each `{"name": ..., "parameters": {...}}` of one of
    the tools (one call only with `parallel_tool_calls: false`); a named function: that
    function's parameters. As vLLM's `_get_json_schema_from_tool`, each tool's `$defs` move to
    the top, where the references (`#/$defs/...`) of the array's items find them; unlike it, a
    call may hold no other keys (vLLM's let a small model pad a call until `max_tokens`)."""
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        i, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == name)
        return _json_schema(f"tools.{i}.function.parameters", _parameters(tool))
    if choice != "required":
        return None
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        params = dict(_parameters(tool))
        schema_text(params, f"tools.{i}.function.parameters")
        for name, schema in params.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise FieldError("tools", f"tools: two tools define $defs {name!r} differently")
        calls.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": calls},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return Constraint("tools", StructuredOutputsParams(json=json.dumps(schema, ensure_ascii=False)))


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """The effective `tool_choice` (vLLM's defaults: `auto` with tools, `none` without), after
    checking that it names a tool there is."""
    if tools is not None and not tools:
        raise FieldError("tools", "tools must not be empty; leave it out instead")
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise FieldError("tools", "tools: two tools have the same name")
    if choice is None:
        return "auto" if tools else "none"
    if choice != "none" and not tools:
        raise FieldError("tool_choice", "tool_choice needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise FieldError(
            "tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools"
        )
    return choice
