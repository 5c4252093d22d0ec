"""The OpenAI-compatible HTTP server (stages 1, 2, 9 and 10 of the request path).

FastAPI in the API process: validate, tokenize, hand the request to `AsyncLLM` (which crosses
into the engine-core process), detokenize what comes back and stream it out as SSE. Errors keep
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the status codes the
official client maps to its exceptions.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from stepscope.engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeChatRequest,
    TokenizePromptRequest,
    error_body,
    new_id,
    now,
)
from stepscope.engine.frontend.async_llm import AsyncLLM
from stepscope.engine.frontend.core_client import EngineDeadError
from stepscope.engine.frontend.parallel_sampling import child_requests, interleave
from stepscope.engine.metrics import ServerMetrics
from stepscope.engine.outputs import RequestOutput
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names
from stepscope.traces.setup import dropped_spans

VERSION = "0.1.0"


class APIError(Exception):
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


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


@dataclass(slots=True)
class ServerState:
    engine: AsyncLLM
    model_name: str
    api_key: str | None
    max_queued_requests: int
    metrics: ServerMetrics
    in_flight: int = 0


def build_app(
    engine_factory,
    model_name: str,
    api_key: str | None = None,
    max_queued_requests: int = 256,
    api_server: int | None = None,
    process_list=None,
) -> FastAPI:
    """`engine_factory()` builds the AsyncLLM when the server starts (its processes with it).
    With several API servers, `api_server` is this one's index and `process_list()` lists every
    process of the deployment (default: the engine's own list)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = engine_factory()
        engine.start()
        app.state.s = ServerState(
            engine, model_name, api_key, max_queued_requests, ServerMetrics(model_name, api_server)
        )
        app.state.process_list = process_list or engine.processes
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="stepscope", version=VERSION, lifespan=lifespan)
    app.openapi = lambda: _openapi(app, model_name)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, exc.type, exc.param, exc.code),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        cause = first.get("ctx", {}).get("error")
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', message)}"
            loc = []
        elif isinstance(cause, FieldError):
            message, loc = str(cause), [cause.param]
        elif loc:
            message = f"{'.'.join(loc)}: {message}"
        return JSONResponse(
            error_body(message, "invalid_request_error", ".".join(loc) or None, 400),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind, None, exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,  # e.g. `Allow` on a 405
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: still OpenAI's shape, never a plain-text page.
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error", None, 500),
            status_code=500,
        )

    app.add_middleware(_APIKeyCheck)

    @app.get("/health", response_class=PlainTextResponse, responses=_ERRORS_503)
    async def health(request: Request) -> Any:
        engine = request.app.state.s.engine
        if engine.is_dead:
            return JSONResponse(error_body(engine.dead_reason, "engine_dead", None, 503), 503)
        return PlainTextResponse("")

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/processes")
    async def processes(request: Request) -> dict:
        """Every process serving this server: role, rank, pid and DP rank (stepscope's own)."""
        return {
            "object": "list",
            "data": [
                {"role": p.role, "rank": p.rank, "pid": p.pid, "dp_rank": p.dp_rank}
                for p in request.app.state.process_list()
            ],
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        s: ServerState = request.app.state.s
        return {
            "object": "list",
            "data": [
                {
                    "id": s.model_name,
                    "object": "model",
                    "created": now(),
                    "owned_by": "stepscope",
                    "max_model_len": s.engine.max_model_len,
                }
            ],
        }

    @app.get("/metrics", response_class=PlainTextResponse, responses=_ERRORS_503)
    async def metrics(request: Request) -> PlainTextResponse:
        s: ServerState = request.app.state.s
        try:
            stats = await asyncio.wait_for(s.engine.get_stats(), timeout=5)
        except (EngineDeadError, TimeoutError) as e:
            raise APIError(503, f"engine unavailable: {e}", "engine_dead") from e
        dropped = dropped_spans() + int(stats.get("trace_spans_dropped", 0))
        return PlainTextResponse(
            s.metrics.render(stats, s.in_flight, dropped), media_type="text/plain; version=0.0.4"
        )

    # The tokenizer endpoints vLLM offers, which clients such as lm-evaluation-harness use to
    # tokenize exactly as the server does (its `tokenizer_backend=remote`).
    @app.post("/tokenize")
    async def tokenize(body: TokenizePromptRequest | TokenizeChatRequest, request: Request) -> dict:
        s: ServerState = request.app.state.s
        if body.model is not None:
            _check_model(s, body.model)
        processor = s.engine.processor
        try:
            if isinstance(body, TokenizeChatRequest):
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                ids = processor.apply_chat_template(messages)
            else:
                ids = s.engine.tokenizer.encode(
                    body.prompt, add_special_tokens=body.add_special_tokens
                )
        except ValueError as e:
            raise bad_request(
                str(e), "messages" if isinstance(body, TokenizeChatRequest) else "prompt"
            ) from e
        return {"count": len(ids), "max_model_len": s.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        s: ServerState = request.app.state.s
        if body.model is not None:
            _check_model(s, body.model)
        vocab = s.engine.processor.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad_request(f"tokens must be token ids in [0, {vocab})", "tokens")
        return {"prompt": s.engine.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict:
        s: ServerState = request.app.state.s
        tok = s.engine.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
            "model_max_length": s.engine.max_model_len,
            "vocab_size": s.engine.processor.vocab_size,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        received = time.time()  # stage 1 starts here: tokenizing is part of it
        s: ServerState = request.app.state.s
        _check_model(s, body.model)
        prompts = _completion_prompts(body.prompt)
        echo = None
        max_tokens = body.max_tokens
        if body.echo:
            # `echo` with `max_tokens: 0` scores the prompt and generates nothing (what
            # loglikelihood evals send); the engine still runs one step, whose token is dropped.
            echo = _Echo(prompts, score_only=max_tokens == 0)
            max_tokens = 1 if max_tokens == 0 else max_tokens
        params = _sampling_params(
            body, max_tokens, body.logprobs, body.logprobs if body.echo else None
        )
        token_lists = [_tokenize(s, p) for p in prompts]
        return await _serve(
            s, request, body, "text_completion", token_lists, params, received, echo
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        received = time.time()
        s: ServerState = request.app.state.s
        _check_model(s, body.model)
        top = body.top_logprobs if body.top_logprobs is not None else 0
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = _sampling_params(body, max_tokens, top if body.logprobs else None)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = s.engine.processor.apply_chat_template(messages)
        except ValueError as e:
            raise bad_request(str(e), "messages") from e
        _check_length(s, ids, params)
        return await _serve(s, request, body, "chat", [ids], params, received)

    return app


class _APIKeyCheck:
    """`Authorization: Bearer KEY` on /v1/ when the server has a key: a plain ASGI middleware.

    Not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides the client's disconnect
    from the endpoint, so a non-streaming request whose client gave up ran to its end.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            key = scope["app"].state.s.api_key
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if key and not secrets.compare_digest(given, f"Bearer {key}"):
                body = error_body(
                    "invalid or missing API key", "authentication_error", None, "invalid_api_key"
                )
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- the OpenAPI description ------------------------------------------------------------------
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_ERRORS_503 = {503: {"description": "the engine is dead or unavailable"}}
# What every endpoint under /v1 may answer besides 200 (OpenAI's codes, not FastAPI's 422).
_V1_ERRORS = {
    "400": "invalid request: the body or one of its values is refused",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "500": "a bug in the server",
    "503": "the engine is dead, or the server is at capacity (see Retry-After)",
}


def _openapi(app: FastAPI, model_name: str) -> dict:
    """FastAPI's schema with the error answers the server really gives, in OpenAI's shape, and
    the one model this server serves (so that a fuzzer's requests reach the engine)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error = {"application/json": {"schema": _ERROR_SCHEMA}}
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                responses = operation["responses"]
                responses.pop("422", None)
                if path.startswith("/v1/"):
                    for code, text in _V1_ERRORS.items():
                        responses[code] = {"description": text, "content": error}
                elif path in ("/tokenize", "/detokenize"):
                    for code in ("400", "404", "500"):
                        text = _V1_ERRORS[code]
                        responses[code] = {"description": text, "content": error}
                elif "503" in responses:  # /health and /metrics
                    responses["503"]["content"] = error
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            schema["components"]["schemas"][name]["properties"]["model"]["enum"] = [model_name]
        for path in ("/v1/completions", "/v1/chat/completions"):
            ok = schema["paths"][path]["post"]["responses"]["200"]
            ok["content"]["text/event-stream"] = {"schema": {}}  # stream: true; chunks as JSON
        app.openapi_schema = schema
    return app.openapi_schema


# ---- request handling ---------------------------------------------------------------------------
def _check_model(s: ServerState, model: str) -> None:
    if model != s.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {s.model_name!r}",
            "not_found_error",
            "model",
            "model_not_found",
        )


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


def _sampling_params(
    body: Any, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    logit_bias = None
    if body.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in body.logit_bias.items()}
        except ValueError:
            raise bad_request(
                "logit_bias keys must be token ids (integers)", "logit_bias"
            ) from None
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            logit_bias=logit_bias,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        )
    except ValueError as e:
        # SamplingParams' messages start with the field they refuse ("top_k must be ...").
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), name if name in type(body).model_fields else None) from e


def _tokenize(s: ServerState, prompt: str | list[int]) -> list[int]:
    try:
        return s.engine.processor.tokenize(prompt)
    except ValueError as e:
        raise bad_request(str(e), "prompt") from e


def _check_length(s: ServerState, ids: list[int], params: SamplingParams) -> None:
    try:
        s.engine.processor.validate_prompt(ids)
    except ValueError as e:
        raise bad_request(str(e), "prompt") from e
    try:
        s.engine.processor.validate_max_tokens(ids, params)
    except ValueError as e:
        raise bad_request(str(e), "max_tokens") from e
    try:
        s.engine.processor.validate_token_ids(params)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from e
    try:
        s.engine.processor.validate_stop(params)
    except ValueError as e:
        raise bad_request(str(e), "stop") from e


async def _serve(
    s: ServerState,
    request: Request,
    body: Any,
    kind: str,
    token_lists: list[list[int]],
    params: SamplingParams,
    received: float,
    echo: _Echo | None = None,
) -> Any:
    for ids in token_lists:
        _check_length(s, ids, params)
    num_children = len(token_lists) * params.n
    if s.in_flight + num_children > s.max_queued_requests:
        s.metrics.rejected_queue_full += 1
        raise APIError(
            503,
            "the server is at capacity; retry later",
            "server_overloaded",
            headers={"Retry-After": "1"},
        )
    # Reserve the slots now, before any await, so concurrent handlers see each other.
    slot = _Slot(s, num_children)
    base_id = new_id("chatcmpl" if kind == "chat" else "cmpl")
    # Choice index p_idx * n + i is the i-th child of prompt p_idx.
    children = [
        (p_idx * params.n + i, ids, child_params, child_id)
        for p_idx, ids in enumerate(token_lists)
        for i, (child_id, child_params) in enumerate(child_requests(f"{base_id}-{p_idx}", params))
    ]
    operation = names.OPERATION_CHAT if kind == "chat" else names.OPERATION_TEXT_COMPLETION
    headers = {k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")}
    stream = _merged(s, children, slot, operation, headers, received)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(s, kind, base_id, stream, include_usage, token_lists, params, echo),
            media_type="text/event-stream",
            background=BackgroundTask(slot.release),
        )
    try:
        return await _full(s, request, kind, base_id, stream, token_lists, params, echo)
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
    s: ServerState,
    children: list,
    slot: _Slot,
    operation: str,
    headers: dict[str, str],
    received: float,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of every child request as they arrive."""
    streams = {
        index: _observed(
            s,
            len(ids),
            s.engine.generate(
                ids, p, rid, operation=operation, trace_headers=headers, arrival_time=received
            ),
        )
        for index, ids, p, rid in children
    }
    merged = interleave(streams)
    try:
        async for item in merged:
            yield item
    finally:
        await merged.aclose()  # cancels the children still running
        slot.release()


async def _observed(
    s: ServerState, num_prompt_tokens: int, outputs: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    """One child's outputs, recording its inter-token latency and, once finished, its timings."""
    started = time.time()
    last = None
    num_tokens = 0
    async with aclosing(outputs):
        async for out in outputs:
            t = time.time()
            new = len(out.outputs[0].token_ids)
            if last is not None and new:
                s.metrics.itl.observe((t - last) / new)
            if new:
                last = t
            num_tokens += new
            if out.finished:
                m = out.metrics
                s.metrics.observe_finished(
                    out.outputs[0].finish_reason or "abort",
                    num_prompt_tokens,
                    num_tokens,
                    m.queue_time,
                    m.ttft,
                    (m.finished_time or t) - started,
                )
            yield out


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is dead: {e}", "engine_dead")
    if isinstance(e, ValueError):
        return bad_request(str(e))
    return APIError(500, f"{type(e).__name__}: {e}", "internal_error")


def _top(lp: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The top-n of one position: its dict holds the sampled token and the top-n, which overlap."""
    return sorted(lp.items(), key=lambda kv: -kv[1])[:n]


def _completion_logprobs(tokenizer, out_logprobs, token_ids, n: int) -> dict:
    tokens = [tokenizer.convert_ids_to_tokens(t) for t in token_ids]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.get(t) for lp, t in zip(out_logprobs, token_ids, strict=False)],
        "top_logprobs": [
            {tokenizer.convert_ids_to_tokens(k): v for k, v in _top(lp, n)} for lp in out_logprobs
        ],
        "text_offset": [],
    }


@dataclass(slots=True)
class _Echo:
    """`echo` on /v1/completions: each choice starts with its prompt (text, and with `logprobs`
    the prompt tokens' logprobs, the first one null); `score_only` (`max_tokens: 0`) leaves out
    the completion itself."""

    prompts: list[str | list[int]]
    score_only: bool = False


def _completion_choice(
    tok, params, echo: _Echo | None, p_idx, prompt_ids, prompt_logprobs, text, token_ids, logprobs,
    first,
) -> tuple[str, dict | None, int]:  # fmt: skip
    """A completion choice's (or chunk's) text and logprobs, and how many generated tokens it
    reports; with `echo`, the first one carries prompt `p_idx` in front."""
    if echo is not None and echo.score_only:
        text, token_ids, logprobs = "", [], []
    body = None
    if params.logprobs is not None:
        body = _completion_logprobs(tok, logprobs, token_ids, params.logprobs)
    if echo is not None and first:
        prompt = echo.prompts[p_idx]
        text = (prompt if isinstance(prompt, str) else tok.decode(prompt_ids)) + text
        if body is not None:
            scored = prompt_logprobs or [None]  # RequestOutput.prompt_logprobs
            if len(scored) != len(prompt_ids):
                raise RuntimeError("the engine returned no prompt logprobs for an echo")
            head = {
                "tokens": tok.convert_ids_to_tokens(prompt_ids),
                "token_logprobs": [None]
                + [lp[t] for lp, t in zip(scored[1:], prompt_ids[1:], strict=True)],
                "top_logprobs": [None]
                + [
                    {tok.convert_ids_to_tokens(k): v for k, v in _top(lp, params.logprobs)}
                    for lp in scored[1:]
                ],
            }
            body = {key: head[key] + body[key] for key in head} | {"text_offset": []}
    return text, body, len(token_ids)


def _chat_logprobs(tokenizer, out_logprobs, token_ids, n: int) -> dict:
    content = []
    for lp, t in zip(out_logprobs, token_ids, strict=False):
        tok = tokenizer.decode([t])
        top = [
            {
                "token": tokenizer.decode([k]),
                "logprob": v,
                "bytes": list(tokenizer.decode([k]).encode()),
            }
            for k, v in _top(lp, n)
        ]
        content.append(
            {"token": tok, "logprob": lp.get(t), "bytes": list(tok.encode()), "top_logprobs": top}
        )
    return {"content": content}


async def _full(s, request, kind, base_id, stream, token_lists, params, echo=None) -> dict:
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    lps: dict[int, list[dict]] = {}
    prompt_lps: dict[int, list] = {}
    finish: dict[int, str | None] = {}
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        async for index, out in _race(stream, watcher):
            c = out.outputs[0]
            texts.setdefault(index, []).append(c.text)
            ids.setdefault(index, []).extend(c.token_ids)
            lps.setdefault(index, []).extend(c.logprobs or [])
            if out.prompt_logprobs:
                prompt_lps[index] = out.prompt_logprobs
            if out.finished:
                finish[index] = c.finish_reason
    except APIError:
        raise
    except BaseException as e:
        raise _engine_error(e) from e
    finally:
        watcher.cancel()
    tok = s.engine.tokenizer
    choices = []
    for index in sorted(texts):
        text = "".join(texts[index])
        if kind == "chat":
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": _chat_logprobs(tok, lps[index], ids[index], params.logprobs)
                if params.logprobs is not None
                else None,
                "finish_reason": finish.get(index),
            }
        else:
            p_idx = index // params.n
            text, logprobs, num_tokens = _completion_choice(
                tok, params, echo, p_idx, token_lists[p_idx], prompt_lps.get(index),
                text, ids[index], lps[index], first=True,
            )  # fmt: skip
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish.get(index),
            }
            ids[index] = ids[index][:num_tokens]
        choices.append(choice)
    prompt_tokens = sum(len(t) for t in token_lists)
    completion_tokens = sum(len(v) for v in ids.values())
    return {
        "id": base_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": now(),
        "model": s.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)


async def _race(stream: AsyncIterator, watcher: asyncio.Task) -> AsyncIterator:
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


async def _sse(
    s, kind, base_id, stream, include_usage, token_lists, params, echo=None
) -> AsyncIterator[str]:
    created = now()
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    tok = s.engine.tokenizer
    counts: dict[int, int] = {}
    started: set[int] = set()

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": base_id,
            "object": obj,
            "created": created,
            "model": s.model_name,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        async for index, out in stream:
            c = out.outputs[0]
            if kind == "chat":
                counts[index] = counts.get(index, 0) + len(c.token_ids)
                delta: dict[str, Any] = {}
                if index not in started:
                    delta["role"] = "assistant"
                    started.add(index)
                if c.text or out.finished:
                    delta["content"] = c.text
                lp = (
                    _chat_logprobs(tok, c.logprobs or [], c.token_ids, params.logprobs)
                    if params.logprobs is not None
                    else None
                )
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason if out.finished else None,
                }
            else:
                p_idx = index // params.n
                text, lp, num_tokens = _completion_choice(
                    tok, params, echo, p_idx, token_lists[p_idx], out.prompt_logprobs,
                    c.text, c.token_ids, c.logprobs or [], first=index not in started,
                )  # fmt: skip
                started.add(index)
                counts[index] = counts.get(index, 0) + num_tokens
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason if out.finished else None,
                }
            yield chunk([choice])
    except BaseException as e:
        if isinstance(e, asyncio.CancelledError | GeneratorExit):
            raise
        err = _engine_error(e)
        yield f"data: {json.dumps(error_body(err.message, err.type, None, err.code))}\n\n"
        yield "data: [DONE]\n\n"
        return
    finally:
        await stream.aclose()
    if include_usage:
        prompt_tokens = sum(len(t) for t in token_lists)
        completion = sum(counts.values())
        yield chunk(
            [],
            {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        )
    yield "data: [DONE]\n\n"


# ---- one of several API-server processes (started by engine/entrypoints/launcher.py) ---------
def main() -> None:
    """Serve on the launcher's shared socket, attached to the engine cores it started."""
    import signal
    import sys

    import msgspec
    import uvicorn

    from stepscope.engine.entrypoints.launcher import APIServerArgs, read_processes
    from stepscope.traces import names
    from stepscope.traces.process import exit_once_on, ignore_terminal_signals, watch_parent
    from stepscope.traces.setup import init_process_tracing, shutdown_tracing

    args = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=APIServerArgs)
    watch_parent(args.parent_pid)
    engine_args = args.engine_args
    init_process_tracing(
        names.SERVICE_API,
        rank=args.index,
        collector_endpoint=engine_args.get("collector_endpoint"),
        otlp_endpoint=engine_args.get("otlp_endpoint"),
        trace_steps=engine_args.get("trace_steps", "all"),
    )
    app = build_app(
        lambda: AsyncLLM(
            args.model,
            engine_handles=args.handles,
            client_index=args.index,
            output_addr=args.output_addr,
            **engine_args,
        ),
        model_name=args.served_model_name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        api_server=args.index,
        process_list=lambda: read_processes(args.processes_file),
    )
    config = uvicorn.Config(app, fd=args.fd, log_level="warning", timeout_graceful_shutdown=5)
    # uvicorn stops gracefully on SIGTERM, then raises it again with the handler it found: make
    # that an exit that unwinds (and flushes this process's spans), not a kill, and not cut
    # short by the launcher's SIGTERM arriving after the group's.
    exit_once_on(signal.SIGTERM)
    ignore_terminal_signals()  # Ctrl-C and hang-ups are the launcher's to handle
    try:
        uvicorn.Server(config).run()
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
