"""The OpenAI-compatible HTTP server's routes (stages 1 and 10 of the request path).

FastAPI in the API process: the routes (one `APIRouter`), their errors, the app that holds them
(`build_app`), and `main`, one API-server process of several. A completion or chat route turns
the body into prompts and `SamplingParams` and hands them to serving.py, which runs them through
`AsyncLLM` (into the engine-core process and back) and answers with openai_responses.py's bodies,
whole or streamed as SSE. Routes reach the engine through `AsyncLLM`'s methods only, so a route
can be tested with a stand-in engine on `app.state.s`. Errors keep OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with the status codes the official client
maps to its exceptions; bad input is a `FieldError`, a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stepscope.engine.entrypoints.openai_responses import (
    ChatResponses,
    CompletionResponses,
    Echo,
)
from stepscope.engine.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeChatRequest,
    TokenizePromptRequest,
    error_body,
    now,
)
from stepscope.engine.entrypoints.serving import ServerOptions, ServerState, serve
from stepscope.engine.entrypoints.structured_outputs import NamedToolChoice, engine_errors_named
from stepscope.engine.entrypoints.tool_parsers import (
    HermesToolParser,
    NamedCallParser,
    RequiredCallsParser,
    ToolCallParser,
    template_messages,
    template_renders_tools,
    tools_as_system_text,
)
from stepscope.engine.frontend.async_llm import AsyncLLM
from stepscope.engine.frontend.engine_group import EngineDeadError
from stepscope.engine.metrics import ServerMetrics
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces.setup import dropped_spans

VERSION = "0.1.0"


def build_app(
    engine_factory, options: ServerOptions, api_server: int | None = None, process_list=None
) -> FastAPI:
    """`engine_factory()` builds the AsyncLLM when the server starts (its processes with it).
    With several API servers, `api_server` is this one's index and `process_list()` lists every
    process of the deployment (default: the engine's own list). `options.niceness`: how much
    this process lowers its scheduling priority once the engine has started (on a CPU)."""
    model_name, niceness = options.model_name, options.niceness

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = engine_factory()
        engine.start()
        if niceness:
            # On a CPU the engine's forward runs an OpenMP thread per core, and an API server
            # that takes a core mid-step stalls them all at their next barrier. Lowered, its
            # work per step (detokenizing, JSON, SSE) runs in the gaps between parallel
            # regions and steps instead. After the engine started: its processes keep theirs.
            os.nice(niceness)
        app.state.s = ServerState(
            engine, model_name, options.api_key, options.max_queued_requests,
            ServerMetrics(model_name, api_server),
            per_request_metrics=options.enable_per_request_metrics,
            tool_call_parser=options.tool_call_parser,
        )  # fmt: skip
        app.state.process_list = process_list or engine.processes
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="stepscope", version=VERSION, lifespan=lifespan)
    app.openapi = lambda: _openapi(app, model_name)
    for exc_class, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
    app.add_middleware(_APIKeyCheck)
    app.include_router(router)
    return app


# ---- errors, in OpenAI's shape ------------------------------------------------------------------
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.type, exc.param, exc.code),
        status_code=exc.status,
        headers=exc.headers,
    )


async def _field_error(request: Request, exc: FieldError) -> JSONResponse:
    return JSONResponse(
        error_body(str(exc), "invalid_request_error", exc.param, 400), status_code=400
    )


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
    elif first.get("type") == "extra_forbidden":
        message = (
            f"{'.'.join(loc)}: not supported by this server; a field that would change the "
            "output is refused rather than ignored (the README lists the fields accepted)"
        )
    elif loc:
        message = f"{'.'.join(loc)}: {message}"
    return JSONResponse(
        error_body(message, "invalid_request_error", ".".join(loc) or None, 400),
        status_code=400,
    )


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        error_body(str(exc.detail), kind, None, exc.status_code),
        status_code=exc.status_code,
        headers=exc.headers,  # e.g. `Allow` on a 405
    )


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # A bug, not bad input: still OpenAI's shape, never a plain-text page.
    return JSONResponse(
        error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error", None, 500),
        status_code=500,
    )


EXCEPTION_HANDLERS: dict[type[Exception], Callable[..., Any]] = {
    APIError: _api_error,
    FieldError: _field_error,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
    Exception: _internal_error,
}


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


# ---- the routes ---------------------------------------------------------------------------------
# Each reads the server's state from `request.app.state.s` (set when the app starts). A route's
# name, docstring and order are its OpenAPI operation id, description and place: keep them.
router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.s


@router.get("/health", response_class=PlainTextResponse, responses=_ERRORS_503)
async def health(request: Request) -> Any:
    engine = _state(request).engine
    if engine.is_dead:
        return JSONResponse(error_body(engine.dead_reason, "engine_dead", None, 503), 503)
    return PlainTextResponse("")


@router.get("/version")
async def version() -> dict:
    return {"version": VERSION}


@router.get("/processes")
async def processes(request: Request) -> dict:
    """Every process serving this server: role, rank, pid and DP rank (stepscope's own)."""
    return {
        "object": "list",
        "data": [
            {"role": p.role, "rank": p.rank, "pid": p.pid, "dp_rank": p.dp_rank}
            for p in request.app.state.process_list()
        ],
    }


@router.get("/v1/models")
async def models(request: Request) -> dict:
    s = _state(request)
    config = s.engine.config
    return {
        "object": "list",
        "data": [
            {
                "id": s.model_name,
                "object": "model",
                "created": now(),
                "owned_by": "stepscope",
                "max_model_len": s.engine.max_model_len,
                "dtype": config.model_config.dtype,
                "dtype_reason": config.model_config.dtype_reason,
                "quantization": config.model_config.quantization,
                "weight_format": config.model_config.weight_format,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "max_num_seqs": config.scheduler_config.max_num_seqs,
            }
        ],
    }


@router.get("/metrics", response_class=PlainTextResponse, responses=_ERRORS_503)
async def metrics(request: Request) -> PlainTextResponse:
    s = _state(request)
    try:
        stats = await asyncio.wait_for(s.engine.get_stats(), timeout=5)
    except (EngineDeadError, TimeoutError) as e:
        raise APIError(503, f"engine unavailable: {e}", "engine_dead") from e
    dropped = dropped_spans() + int(stats.get("trace_spans_dropped", 0))
    return PlainTextResponse(
        s.metrics.render(stats, s.in_flight, dropped), media_type="text/plain; version=0.0.4"
    )


# vLLM's endpoint of the same name: a benchmark that replays a workload starts from an empty
# prefix cache. False while requests run (their blocks cannot be dropped).
@router.post("/reset_prefix_cache", responses=_ERRORS_503)
async def reset_prefix_cache(request: Request) -> dict:
    return {"reset": bool(await _state(request).engine.reset_prefix_cache())}


# The tokenizer endpoints vLLM offers, which clients such as lm-evaluation-harness use to
# tokenize exactly as the server does (its `tokenizer_backend=remote`).
@router.post("/tokenize")
async def tokenize(body: TokenizePromptRequest | TokenizeChatRequest, request: Request) -> dict:
    s = _state(request)
    if body.model is not None:
        _check_model(s, body.model)
    if isinstance(body, TokenizeChatRequest):
        renders = template_renders_tools(s.engine.get_tokenizer().chat_template)
        ids = s.engine.apply_chat_template(template_messages(body.messages, renders))
    else:
        ids = s.engine.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": s.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    s = _state(request)
    if body.model is not None:
        _check_model(s, body.model)
    return {"prompt": s.engine.detokenize(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    return _state(request).engine.tokenizer_info()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    received = time.time()  # stage 1 starts here: tokenizing is part of it
    s = _state(request)
    _check_model(s, body.model)
    prompts = body.prompts()
    params = body.to_sampling_params(s.engine.default_sampling)
    echo = Echo(prompts, score_only=body.score_only) if body.echo else None
    responses = CompletionResponses(s.engine.get_tokenizer(), s.model_name, params, echo)
    return await serve(
        s, request, responses, prompts, params, received, body.stream, _include_usage(body)
    )


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request) -> Any:
    received = time.time()
    s = _state(request)
    _check_model(s, body.model)
    params = body.to_sampling_params(s.engine.default_sampling)
    ids, tool_parser, params = _chat_prompt(s, body, params)
    responses = ChatResponses(s.engine.get_tokenizer(), s.model_name, params, tool_parser)
    with engine_errors_named(body.constraint):
        return await serve(
            s, request, responses, [ids], params, received, body.stream, _include_usage(body)
        )


def _chat_prompt(
    s: ServerState, body: ChatCompletionRequest, params: SamplingParams
) -> tuple[list[int], Callable[[], ToolCallParser] | None, SamplingParams]:
    """The chat's prompt ids with its tools, the parser that finds the calls in each choice's
    text (None without tools), and the params that parser needs. vLLM shows the tools to a
    template that renders them even with `tool_choice: none`; a template that cannot gets them
    as a system text when the output must be a call (tool_parsers.py)."""
    tok = s.engine.get_tokenizer()
    choice = body.effective_tool_choice
    renders = template_renders_tools(tok.chat_template)
    messages = template_messages(body.messages, renders)
    parser: Callable[[], ToolCallParser] | None = None
    if choice == "auto":
        if s.tool_call_parser is None:
            raise FieldError(
                "tool_choice",
                "tool_choice auto (the default with tools) needs a server started with "
                "--tool-call-parser; use tool_choice required or a named function",
            )
        if not renders:
            raise FieldError(
                "tool_choice",
                f"tool_choice auto (the default with tools): {s.model_name}'s chat template "
                "does not render tools; use tool_choice required or a named function",
            )
        max_calls = 1 if body.parallel_tool_calls is False else None
        parser = functools.partial(HermesToolParser, max_calls)
        # Hermes models write <tool_call> as a special token: keep it in the text to parse.
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    elif choice == "required":
        parser = RequiredCallsParser
    elif isinstance(choice, NamedToolChoice):
        parser = functools.partial(NamedCallParser, choice.function.name)
    if body.tools and renders:
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        # What InputProcessor.apply_chat_template does, with the tools added.
        text = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        return tok.encode(text, add_special_tokens=False), parser, params
    if parser is not None:
        messages = tools_as_system_text(messages, body.tools or [], choice)
    return s.engine.apply_chat_template(messages), parser, params


def _check_model(s: ServerState, model: str) -> None:
    if model != s.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {s.model_name!r}",
            "not_found_error",
            "model",
            "model_not_found",
        )


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- one of several API-server processes (started by engine/entrypoints/launcher.py) ---------
def main() -> None:
    """Serve on the launcher's shared socket, attached to the engine cores it started."""
    import signal
    import sys

    import uvicorn

    from stepscope.engine.config import init_engine_process_tracing
    from stepscope.engine.entrypoints.launcher import APIServerArgs, read_processes
    from stepscope.traces import names
    from stepscope.traces.process import exit_once_on, ignore_terminal_signals, watch_parent
    from stepscope.traces.setup import shutdown_tracing

    args = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=APIServerArgs)
    watch_parent(args.parent_pid)
    index = args.attach.client_index
    init_engine_process_tracing(names.SERVICE_API, args.config, args.endpoints, rank=index)
    name = args.options.model_name
    app = build_app(
        lambda: AsyncLLM(
            config=args.config, endpoints=args.endpoints, attach=args.attach, model_name=name
        ),  # fmt: skip
        args.options,
        api_server=index,
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
