"""Serving one completion or chat request in the API server (between stages 1 and 10).

What does not depend on the endpoint: one `AsyncLLM.generate` per prompt (which tokenizes and
validates it, and fans n > 1 out itself), the bound on requests in flight, the server's latency
metrics, the race with a client that goes away, and the plumbing of a whole response or an SSE
stream. What the bodies look like is openai_responses.py's (vLLM: `OpenAIServing` and its
subclasses in vllm/entrypoints/openai/).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from stepscope.engine.entrypoints.openai_responses import (
    Increment,
    Responses,
    increments,
    joined,
    timing_metrics,
    usage,
)
from stepscope.engine.entrypoints.protocol import APIError, error_body, new_id, now
from stepscope.engine.frontend.async_llm import AsyncLLM
from stepscope.engine.frontend.engine_group import EngineDeadError
from stepscope.engine.frontend.input_processor import PromptType
from stepscope.engine.metrics import ServerMetrics
from stepscope.engine.outputs import RequestMetrics, RequestOutput
from stepscope.engine.sampling_params import SamplingParams

T = TypeVar("T")


class ServerOptions(msgspec.Struct, frozen=True):
    """One API server's own settings, from `serve`'s flags beside the engine's: the model name
    it answers to, its API key, how many requests it holds, how far it lowers its priority,
    whether responses carry vLLM's per-request `metrics` object, which parser finds tool calls
    in free text (`tool_choice: auto`; None refuses it)."""

    model_name: str
    api_key: str | None = None
    max_queued_requests: int = 256
    niceness: int = 0
    enable_per_request_metrics: bool = False
    tool_call_parser: str | None = None

    @classmethod
    def from_args(cls, args: Any, model_name: str) -> ServerOptions:
        return cls(
            model_name, args.api_key, args.max_queued_requests, args.api_server_niceness,
            args.enable_per_request_metrics, args.tool_call_parser,
        )  # fmt: skip


@dataclass(slots=True)
class ServerState:
    engine: AsyncLLM
    model_name: str
    api_key: str | None
    max_queued_requests: int
    metrics: ServerMetrics
    in_flight: int = 0
    per_request_metrics: bool = False  # `--enable-per-request-metrics`
    tool_call_parser: str | None = None  # `--tool-call-parser`


async def serve(
    s: ServerState,
    request: Request,
    responses: Responses,
    prompts: list[PromptType],
    params: SamplingParams,
    received: float,
    stream: bool,
    include_usage: bool = False,
) -> Any:
    """Answer one request for `prompts` (each with `params.n` choices): a whole response, or an
    SSE stream with `stream`. Bad input raises `FieldError` before any prompt enters the
    engine."""
    response_id = new_id(responses.id_prefix)
    headers = {k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")}
    # generate() validates as it is called, and sends only once iterated: all or nothing.
    streams = {
        i: s.engine.generate(
            prompt,
            params,
            f"{response_id}-{i}",
            operation=responses.operation,
            trace_headers=headers,
            arrival_time=received,
        )
        for i, prompt in enumerate(prompts)
    }
    num_requests = len(prompts) * params.n  # the engine core's requests
    if s.in_flight + num_requests > s.max_queued_requests:
        s.metrics.rejected_queue_full += 1
        raise APIError(
            503,
            "the server is at capacity; retry later",
            "server_overloaded",
            headers={"Retry-After": "1"},
        )
    # Reserve the slots now, before any await, so concurrent handlers see each other.
    slot = _Slot(s, num_requests)
    outputs = _merged(s, streams, slot)
    # vLLM's per-request `metrics`: only when the server was asked for them, and null for a
    # response that is not one generation stream (n > 1, several prompts).
    timing = None if not s.per_request_metrics else num_requests == 1
    if stream:
        return StreamingResponse(
            _sse(responses, response_id, outputs, include_usage, params.n, timing),
            media_type="text/event-stream",
            background=BackgroundTask(slot.release),
        )
    try:
        return await _full(request, responses, response_id, outputs, params.n, timing)
    finally:
        slot.release()


class _Slot:
    """Requests held by the server for one HTTP call; released exactly once."""

    def __init__(self, s: ServerState, n: int) -> None:
        self.s, self.n = s, n
        s.in_flight += n

    def release(self) -> None:
        self.s.in_flight -= self.n
        self.n = 0


async def _merged(
    s: ServerState, streams: Mapping[int, AsyncIterator[RequestOutput]], slot: _Slot
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Every prompt's outputs as they arrive, each with the prompt's index."""
    merged = interleave({i: _observed(s, stream) for i, stream in streams.items()})
    try:
        async for item in merged:
            yield item
    finally:
        await merged.aclose()  # cancels the prompts still running
        slot.release()


async def _observed(
    s: ServerState, outputs: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    """One prompt's outputs, recording each sequence's inter-token latency and, once it has
    finished, its timings."""
    started = time.time()
    last: dict[int, float] = {}  # by sequence: when it last got tokens
    num_tokens: dict[int, int] = {}
    async with aclosing(outputs):
        async for out in outputs:
            t = time.time()
            for c, m in zip(out.outputs, out.children_metrics, strict=True):
                new = len(c.token_ids)
                if c.index in last and new:
                    s.metrics.itl.observe((t - last[c.index]) / new)
                if new:
                    last[c.index] = t
                num_tokens[c.index] = num_tokens.get(c.index, 0) + new
                if c.finish_reason is not None:
                    s.metrics.observe_finished(
                        c.finish_reason,
                        len(out.prompt_token_ids),
                        num_tokens[c.index],
                        m.queue_time,
                        m.ttft,
                        (m.finished_time or t) - started,
                    )
            yield out


async def interleave(streams: Mapping[int, AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Every stream's items as they arrive, each with its key. The first error raised by a
    stream is raised here; closing this iterator cancels the streams still running."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(key: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((key, item))
        except BaseException as e:
            await queue.put((key, e))
        finally:
            await queue.put((key, done))

    tasks = [asyncio.create_task(pump(key, stream)) for key, stream in streams.items()]
    remaining = len(tasks)
    try:
        while remaining:
            key, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield key, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is dead: {e}", "engine_dead")
    if isinstance(e, ValueError):
        return APIError(400, str(e), "invalid_request_error")
    return APIError(500, f"{type(e).__name__}: {e}", "internal_error")


async def _full(
    request: Request,
    responses: Responses,
    response_id: str,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    n: int,
    timing: bool | None = None,
) -> dict:
    parts: dict[int, list[Increment]] = {}  # by choice
    seen: set[int] = set()
    timeline = None
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        async for prompt_index, out in _race(outputs, watcher):
            timeline = out.metrics
            for part in increments(prompt_index, out, n, seen):
                parts.setdefault(part.index, []).append(part)
    except APIError:
        raise
    except BaseException as e:
        raise _engine_error(e) from e
    finally:
        watcher.cancel()
    body = responses.response(response_id, [joined(p) for p in parts.values()])
    _add_metrics(body, timing, timeline, body["usage"]["completion_tokens"])
    return body


def _add_metrics(
    body: dict, timing: bool | None, timeline: RequestMetrics | None, num_tokens: int
) -> None:
    """`timing` None: no `metrics` key (the server was not asked for them); False: null (not
    one generation stream); True: the request's timing (openai_responses.timing_metrics)."""
    if timing is not None:
        body["metrics"] = timing_metrics(timeline, num_tokens) if timing else None


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)


async def _race(stream: AsyncGenerator, watcher: asyncio.Task) -> AsyncIterator:
    """Yield from `stream` until it ends or the client disconnects (then abort by closing it)."""
    try:
        while True:
            nxt = asyncio.ensure_future(stream.__anext__())
            await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                return
            try:
                yield nxt.result()
            except StopAsyncIteration:
                return
    finally:
        await stream.aclose()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _sse(
    responses: Responses,
    response_id: str,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    include_usage: bool,
    n: int,
    timing: bool | None = None,
) -> AsyncIterator[str]:
    """One chunk per increment of a choice, then the usage (with `include_usage`; and there, as
    vLLM does, the per-request `metrics`) and [DONE]."""
    created = now()
    prompt_tokens: dict[int, int] = {}  # by prompt
    num_tokens: dict[int, int] = {}  # by choice: the generated tokens its chunks reported
    seen: set[int] = set()
    timeline = None
    try:
        async for prompt_index, out in outputs:
            timeline = out.metrics
            prompt_tokens[prompt_index] = len(out.prompt_token_ids)
            for part in increments(prompt_index, out, n, seen):
                choice, num = responses.delta(part)
                num_tokens[part.index] = num_tokens.get(part.index, 0) + num
                yield _event(responses.chunk(response_id, created, [choice], include_usage))
    except BaseException as e:
        if isinstance(e, asyncio.CancelledError | GeneratorExit):
            raise
        err = _engine_error(e)
        yield _event(error_body(err.message, err.type, None, err.code))
        yield "data: [DONE]\n\n"
        return
    finally:
        await outputs.aclose()
    if include_usage:
        total = usage(sum(prompt_tokens.values()), sum(num_tokens.values()))
        body = responses.chunk(response_id, created, [], include_usage, total)
        _add_metrics(body, timing, timeline, total["completion_tokens"])
        yield _event(body)
    yield "data: [DONE]\n\n"
