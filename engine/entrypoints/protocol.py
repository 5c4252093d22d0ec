"""OpenAI-compatible request and response bodies (stage 1: what crosses HTTP).

Requests are pydantic models, so /openapi.json describes them; anything they accept still goes
through SamplingParams' own validation (`to_sampling_params`) before it reaches the engine. Bad
input anywhere on the way raises `FieldError`, which names the field; `APIError` is any other
answer that is not a 200, in OpenAI's error shape (`error_body`).

A field a request model does not declare is a 400 naming it: one that would change the output and
is not implemented must not be accepted and ignored. The fields that are accepted and ignored
because they change nothing that is generated are declared too (`_Ignored`), so the list is one
place, and /openapi.json shows it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from stepscope.engine.entrypoints.structured_outputs import (
    Constraint,
    ResponseFormat,
    StructuredOutputsRequest,
    Tool,
    ToolChoice,
    check_tools,
    constraint,
    tool_constraint,
)

# FieldError is defined beside SamplingParams, which raises it (in every process).
from stepscope.engine.sampling_params import FieldError, SamplingParams


class APIError(Exception):
    """An answer other than 200: its status, and the error body's type, param and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code if code is not None else status
        self.headers = headers


def _first_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string in a decoded JSON body that is not valid Unicode text.

    JSON may escape half of a surrogate pair (`"\\ud800"`); Python decodes it into a string
    that no tokenizer or UTF-8 encoder accepts.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _first_lone_surrogate(key, path) or _first_lone_surrogate(
            item, f"{path}.{key}" if path else str(key)
        )
        if found:
            return found
    return None


def text_is_unicode(data: Any) -> Any:
    """A body validator: refuse a body that holds a lone surrogate anywhere."""
    where = _first_lone_surrogate(data)
    if where is not None:
        raise FieldError(where, f"{where}: holds a lone UTF-16 surrogate, which is not valid text")
    return data


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Ignored(BaseModel):
    """OpenAI's fields that change nothing this server generates: accepted and ignored (the
    OpenAI SDK, LangChain and LiteLLM send some of them). Every other unknown field is a 400."""

    user: str | None = None  # who asked: for the provider's abuse monitoring
    metadata: dict[str, Any] | None = None  # tags for stored completions
    store: bool | None = None  # whether the provider keeps the completion
    service_tier: str | None = None  # which of the provider's queues to bill
    prompt_cache_key: str | None = None  # a routing hint for the provider's prompt cache
    safety_identifier: str | None = None  # `user`'s successor


class _Common(_Ignored):
    # An unknown field is a 400 naming it (see the module's docstring). NaN and infinity are no
    # number a sampler can use.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's shape: token id (a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # OpenAI's penalties, each in [-2, 2], and vLLM's repetition_penalty (> 0); null is the default.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # What the output must match (structured_outputs.py): OpenAI's `response_format`, vLLM's
    # `structured_outputs`, and vLLM's older `guided_*` fields, mapped onto it as vLLM did.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: Constraint | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        return text_is_unicode(data)

    @model_validator(mode="after")
    def _one_constraint(self) -> _Common:
        guided = {
            name: getattr(self, name)
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        }
        self._constraint = constraint(
            self.response_format, self.structured_outputs, guided, self._tool_constraint()
        )
        return self

    def _tool_constraint(self) -> Constraint | None:
        return None  # chat's tool_choice

    @property
    def constraint(self) -> Constraint | None:
        """The request's one constraint on the output, and the field it came from."""
        return self._constraint

    def _sampling_params(
        self,
        defaults: dict[str, Any],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """`defaults`: the checkpoint's values for fields the request leaves unset (null)."""

        def value(name: str, default: Any) -> Any:
            given = getattr(self, name)
            return defaults.get(name, default) if given is None else given

        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise FieldError(
                    "logit_bias", "logit_bias keys must be token ids (integers)"
                ) from None
        return SamplingParams(
            n=self.n,
            temperature=value("temperature", 1.0),
            top_p=value("top_p", 1.0),
            top_k=value("top_k", 0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=value("repetition_penalty", 1.0),
            structured_outputs=self._constraint.params if self._constraint else None,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's (and vLLM's) default for completions; null generates until the context is full.
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, description="top log-probabilities per token")
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string, one list of token ids, or a list of either."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise FieldError("prompt", "prompt must not be empty")
        if all(isinstance(t, int) for t in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @property
    def score_only(self) -> bool:
        """`echo` with `max_tokens: 0` scores the prompt and generates nothing (what
        loglikelihood evals send); the engine still runs one step, whose token is dropped."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        return self._sampling_params(
            defaults or {},
            1 if self.score_only else self.max_tokens,
            self.logprobs,
            self.logprobs if self.echo else None,
        )


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class MessageToolCall(BaseModel):
    """A call in an assistant message sent back (as the server returned it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    # Other keys of a message (`refusal`, `annotations`, ... of an assistant message sent back)
    # are ignored: no chat template here reads them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant message's calls, and a tool message's answer to one (tool_parsers.py renders
    # them for a chat template that cannot).
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise FieldError("messages", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # None: vLLM's default, `auto` with tools and `none` without (`effective_tool_choice`).
    tool_choice: ToolChoice | None = None
    # false: `tool_choice: required` makes one call, and a parsed `auto` answer keeps its first.
    parallel_tool_calls: bool | None = None

    def _tool_constraint(self) -> Constraint | None:
        choice = check_tools(self.tools, self.tool_choice)
        return tool_constraint(self.tools or [], choice, self.parallel_tool_calls)

    @property
    def effective_tool_choice(self) -> ToolChoice:
        return check_tools(self.tools, self.tool_choice)

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        top = self.top_logprobs if self.top_logprobs is not None else 0
        return self._sampling_params(
            defaults or {},
            self.max_completion_tokens or self.max_tokens,
            top if self.logprobs else None,
        )


class _TokenizeBase(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        return text_is_unicode(data)


class TokenizePromptRequest(_TokenizeBase):
    """vLLM's `/tokenize` of a prompt."""

    prompt: str


class TokenizeChatRequest(_TokenizeBase):
    """vLLM's `/tokenize` of chat messages, through the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
