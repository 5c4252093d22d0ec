"""OpenAI's response bodies (stage 10): one builder per endpoint.

`CompletionResponses` (/v1/completions) and `ChatResponses` (/v1/chat/completions) turn what
the engine's `RequestOutput`s add to each choice (`Increment`s) into OpenAI's shapes: a whole
response, or one streamed chunk per increment (vLLM: the full and stream generators of
`OpenAIServingCompletion` and `OpenAIServingChat`). When a chunk is sent is serving.py's
business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from stepscope.engine.entrypoints.protocol import now
from stepscope.engine.entrypoints.tool_parsers import ToolCallParser
from stepscope.engine.outputs import RequestMetrics, RequestOutput
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names

Logprobs = list[dict[int, float]]  # one {token_id: logprob} per token: the token and the top-n
PromptLogprobs = list[dict[int, float] | None]  # the same per prompt token; None for the first


@dataclass(slots=True)
class Increment:
    """What one output added to a choice; or, `joined`, all that a choice got."""

    index: int  # the choice's
    prompt_index: int  # which of the request's prompts it answers
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    text: str
    token_ids: list[int]
    logprobs: Logprobs
    finish_reason: str | None
    first: bool  # the choice's first increment


def increments(prompt_index: int, out: RequestOutput, n: int, seen: set[int]) -> list[Increment]:
    """What one output of prompt `prompt_index` adds to each choice. OpenAI numbers a request's
    choices across its prompts: sequence k of prompt i is choice i * n + k. `seen` holds the
    choices that had an increment before (these are added to it)."""
    found = []
    for c in out.outputs:
        index = prompt_index * n + c.index
        found.append(
            Increment(
                index=index,
                prompt_index=prompt_index,
                prompt_token_ids=out.prompt_token_ids,
                prompt_logprobs=out.prompt_logprobs,
                text=c.text,
                token_ids=c.token_ids,
                logprobs=c.logprobs or [],
                finish_reason=c.finish_reason,
                first=index not in seen,
            )
        )
        seen.add(index)
    return found


def joined(parts: Sequence[Increment]) -> Increment:
    """A whole choice from its increments, in order."""
    return replace(
        parts[0],
        prompt_logprobs=next(
            (p.prompt_logprobs for p in reversed(parts) if p.prompt_logprobs), None
        ),
        text="".join(p.text for p in parts),
        token_ids=[t for p in parts for t in p.token_ids],
        logprobs=[lp for p in parts for lp in p.logprobs],
        finish_reason=parts[-1].finish_reason,
    )


def timing_metrics(m: RequestMetrics | None, num_generation_tokens: int) -> dict[str, Any]:
    """vLLM's per-request `metrics` object (`--enable-per-request-metrics`), from the request's
    own timeline: the engine core's queued, scheduled and first-token events and its finish
    (the last token). As vLLM's `build_per_request_timing_metrics` (PR #46768;
    docs/features/per_request_metrics.md): TTFT counts from the first scheduling, not from
    arrival; `generation_time_ms` is first to last token; `tokens_per_second` is every
    generated token over scheduling to last token. A field whose times are unknown is None."""
    queued = scheduled = first = last = None
    if m is not None:
        queued, scheduled = m.queued_time, m.first_scheduled_time
        first, last = m.first_token_time, m.finished_time

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (b - a) * 1000

    generation_ms = ms(first, last)
    inference_ms = ms(scheduled, last)
    return {
        "time_to_first_token_ms": ms(scheduled, first),
        "generation_time_ms": generation_ms,
        "queue_time_ms": ms(queued, scheduled),
        "mean_itl_ms": generation_ms / (num_generation_tokens - 1)
        if generation_ms is not None and num_generation_tokens > 1
        else None,
        "tokens_per_second": num_generation_tokens / inference_ms * 1000
        if inference_ms is not None and inference_ms > 0
        else None,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Responses(ABC):
    """What both endpoints share: the envelope of a response and of a chunk, and the usage."""

    id_prefix: ClassVar[str]
    operation: ClassVar[str]  # the GenAI operation name on the request spans
    object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, tokenizer: Any, model_name: str, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.params = params

    @abstractmethod
    def choice(self, whole: Increment) -> tuple[dict, int]:
        """A whole response's choice, and how many generated tokens it reports."""

    @abstractmethod
    def delta(self, part: Increment) -> tuple[dict, int]:
        """A streamed chunk's choice, and how many generated tokens it reports."""

    def response(self, response_id: str, choices: Iterable[Increment]) -> dict:
        bodies = []
        completion_tokens = 0
        prompt_tokens: dict[int, int] = {}
        for whole in sorted(choices, key=lambda c: c.index):
            body, num_tokens = self.choice(whole)
            bodies.append(body)
            completion_tokens += num_tokens
            prompt_tokens[whole.prompt_index] = len(whole.prompt_token_ids)
        return {
            "id": response_id,
            "object": self.object,
            "created": now(),
            "model": self.model_name,
            "choices": bodies,
            "usage": usage(sum(prompt_tokens.values()), completion_tokens),
        }

    def chunk(
        self,
        response_id: str,
        created: int,
        choices: list[dict],
        include_usage: bool,
        usage: dict | None = None,
    ) -> dict:
        body = {
            "id": response_id,
            "object": self.chunk_object,
            "created": created,
            "model": self.model_name,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return body


def _top(lp: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The top-n of one position: its dict holds the sampled token and the top-n, which overlap."""
    return sorted(lp.items(), key=lambda kv: -kv[1])[:n]


@dataclass(slots=True)
class Echo:
    """`echo` on /v1/completions: each choice starts with its prompt (text, and with `logprobs`
    the prompt tokens' logprobs, the first one null); `score_only` (`max_tokens: 0`) leaves out
    the completion itself."""

    prompts: list[str | list[int]]
    score_only: bool = False


class CompletionResponses(Responses):
    """/v1/completions: choices with `text`, OpenAI's completion logprobs, and `echo`. A chunk's
    choice has the shape of a whole one."""

    id_prefix = "cmpl"
    operation = names.OPERATION_TEXT_COMPLETION
    object = chunk_object = "text_completion"

    def __init__(
        self, tokenizer: Any, model_name: str, params: SamplingParams, echo: Echo | None = None
    ) -> None:
        super().__init__(tokenizer, model_name, params)
        self.echo = echo

    def choice(self, whole: Increment) -> tuple[dict, int]:
        return self.delta(whole)

    def delta(self, part: Increment) -> tuple[dict, int]:
        """With `echo`, a choice's first increment carries its prompt in front."""
        echo, tok, top_n = self.echo, self.tokenizer, self.params.logprobs
        text, token_ids, logprobs = part.text, part.token_ids, part.logprobs
        if echo is not None and echo.score_only:
            text, token_ids, logprobs = "", [], []
        body = None
        if top_n is not None:
            body = self._logprobs(logprobs, token_ids, top_n)
        if echo is not None and part.first:
            prompt, prompt_ids = echo.prompts[part.prompt_index], part.prompt_token_ids
            text = (prompt if isinstance(prompt, str) else tok.decode(prompt_ids)) + text
            if body is not None:
                scored = part.prompt_logprobs or [None]
                if len(scored) != len(prompt_ids):
                    raise RuntimeError("the engine returned no prompt logprobs for an echo")
                head = {
                    "tokens": tok.convert_ids_to_tokens(prompt_ids),
                    "token_logprobs": [None]
                    + [lp[t] for lp, t in zip(scored[1:], prompt_ids[1:], strict=True)],
                    "top_logprobs": [None]
                    + [
                        {tok.convert_ids_to_tokens(k): v for k, v in _top(lp, top_n)}
                        for lp in scored[1:]
                    ],
                }
                body = {key: head[key] + body[key] for key in head} | {"text_offset": []}
        choice = {
            "index": part.index,
            "text": text,
            "logprobs": body,
            "finish_reason": part.finish_reason,
        }
        return choice, len(token_ids)

    def _logprobs(self, logprobs: Logprobs, token_ids: list[int], n: int) -> dict:
        tok = self.tokenizer
        return {
            "tokens": [tok.convert_ids_to_tokens(t) for t in token_ids],
            "token_logprobs": [lp.get(t) for lp, t in zip(logprobs, token_ids, strict=False)],
            "top_logprobs": [
                {tok.convert_ids_to_tokens(k): v for k, v in _top(lp, n)} for lp in logprobs
            ],
            "text_offset": [],
        }


class ChatResponses(Responses):
    """/v1/chat/completions: an assistant `message` per choice, a `delta` per chunk, OpenAI's
    chat logprobs. With `tool_parser` (a new parser for each choice; tool_parsers.py), each
    choice's text becomes content and `tool_calls`, and a choice that made calls and stopped
    finishes with `tool_calls`."""

    id_prefix = "chatcmpl"
    operation = names.OPERATION_CHAT
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        params: SamplingParams,
        tool_parser: Callable[[], ToolCallParser] | None = None,
    ) -> None:
        super().__init__(tokenizer, model_name, params)
        self.tool_parser = tool_parser
        self._parsers: dict[int, ToolCallParser] = {}  # by choice, while streaming

    def choice(self, whole: Increment) -> tuple[dict, int]:
        message: dict[str, Any] = {"role": "assistant", "content": whole.text}
        finish = whole.finish_reason
        if self.tool_parser is not None:
            message["content"], calls = self.tool_parser().extract(whole.text)
            if calls:
                message["tool_calls"] = [c.message() for c in calls]
                finish = _with_calls(finish)
        return self._choice(whole, "message", message, finish), len(whole.token_ids)

    def delta(self, part: Increment) -> tuple[dict, int]:
        delta: dict[str, Any] = {"role": "assistant"} if part.first else {}
        finish = part.finish_reason
        if self.tool_parser is None:
            if part.text or finish is not None:
                delta["content"] = part.text
            return self._choice(part, "delta", delta, finish), len(part.token_ids)
        parser = self._parsers.get(part.index)
        if parser is None:
            parser = self._parsers[part.index] = self.tool_parser()
        content, calls = parser.stream(part.text, finish is not None)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if parser.num_calls:
            finish = _with_calls(finish)
        return self._choice(part, "delta", delta, finish), len(part.token_ids)

    def _choice(self, part: Increment, key: str, message: dict, finish: str | None) -> dict:
        return {
            "index": part.index,
            key: message,
            "logprobs": self._logprobs(part.logprobs, part.token_ids),
            "finish_reason": finish,
        }

    def _logprobs(self, logprobs: Logprobs, token_ids: list[int]) -> dict | None:
        n = self.params.logprobs
        if n is None:
            return None
        decode = self.tokenizer.decode
        content = []
        for lp, t in zip(logprobs, token_ids, strict=False):
            token = decode([t])
            top = [
                {"token": decode([k]), "logprob": v, "bytes": list(decode([k]).encode())}
                for k, v in _top(lp, n)
            ]
            content.append(
                {
                    "token": token,
                    "logprob": lp.get(t),
                    "bytes": list(token.encode()),
                    "top_logprobs": top,
                }
            )
        return {"content": content}


def _with_calls(finish_reason: str | None) -> str | None:
    """A choice that made tool calls and stopped finished with `tool_calls` (OpenAI's reason);
    one cut short keeps `length`."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
