"""`AsyncLLM`: the API process's engine (stages 1-2 and 9-10 around an engine-core process).

It tokenizes and validates requests, sends them to the engine core over ZMQ, and turns the token
ids that come back into text with one incremental detokenizer per request. `generate()` is an
async iterator of incremental outputs: each item carries the text and token ids produced since
the previous one. Closing the iterator early (a client that went away) aborts the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from stepscope.engine.config import EngineConfig
from stepscope.engine.frontend.core_client import AsyncMPClient, EngineDeadError
from stepscope.engine.frontend.detokenizer import IncrementalDetokenizer
from stepscope.engine.frontend.input_processor import InputProcessor, PromptType
from stepscope.engine.messages import EngineCoreOutput, EngineCoreOutputs, ProcessInfo
from stepscope.engine.models.loader import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from stepscope.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    prompt_logprobs_of,
)
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names
from stepscope.traces.spans import request_span


@dataclass(slots=True)
class _Stream:
    """A request in flight: its detokenizer and the queue its outputs wait in."""

    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    span: Any  # the request's `stepscope.request` span (a no-op when tracing is off)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_sent_tokens: int = 0
    finished: bool = False


class AsyncLLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        engine_args.setdefault("executor", "mp")
        self.config = EngineConfig(model=model, offline=False, **engine_args)
        self.model_name = model
        self.model_dir = resolve_model(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.client = AsyncMPClient(self.config, self.model_dir)
        self.processor = InputProcessor(
            self.tokenizer, self.client.max_model_len, load_config(self.model_dir)["vocab_size"]
        )
        self._streams: dict[str, _Stream] = {}
        self._started = False
        self.dead_reason: str | None = None

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def start(self) -> None:
        """Begin reading outputs and watching the engine core (inside the running loop)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if not self._started:
            self.client.start(self._on_outputs, self._on_dead)
            self._started = True

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        operation: str = names.OPERATION_TEXT_COMPLETION,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs of one request. `trace_headers` (an incoming W3C `traceparent`)
        become the parent of the request's span."""
        self._ensure_started()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        token_ids = self.processor.tokenize(prompt)
        request = self.processor.process(request_id, token_ids, sampling_params)
        span = request_span(
            request_id,
            model=self.model_name,
            operation=operation,
            max_tokens=sampling_params.max_tokens,
            temperature=sampling_params.temperature,
            top_p=sampling_params.top_p,
            input_tokens=len(token_ids),
            headers=trace_headers,
            start_ns=int(request.arrival_time * 1e9),
        )
        stream = _Stream(
            prompt_token_ids=token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, sampling_params),
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            span=span,
        )
        self._streams[request_id] = stream
        try:
            with span.current():
                await self.client.add_request(request)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                span.finish(finish_reasons=["abort"])
                await self.client.abort_requests([request_id])
            span.end()

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        await self.client.abort_requests([request_id])

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        to_abort = []
        for out in outputs.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.finished:
                continue
            item, stopped_here = self._make_output(out, stream)
            if stopped_here:
                to_abort.append(out.request_id)
            stream.queue.put_nowait(item)
        if to_abort:
            asyncio.get_running_loop().create_task(self.client.abort_requests(to_abort))

    def _make_output(self, out: EngineCoreOutput, stream: _Stream) -> tuple[RequestOutput, bool]:
        m = stream.metrics
        m.update(out.events, out.num_cached_tokens, out.num_preemptions)
        stream.span.observe(out)
        finished = out.finish_reason is not None
        detok = stream.detokenizer
        stop = detok.update(out.new_token_ids, finished)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if stop is not None:
            finish_reason, stop_reason = "stop", stop
        done = finish_reason is not None
        if done:
            stream.finished = True
            m.finished_time = out.events.get("finished", time.time())
            stream.span.finish(output_tokens=len(detok.token_ids), finish_reasons=[finish_reason])
        new_tokens = detok.token_ids[stream.num_sent_tokens :]
        stream.num_sent_tokens = len(detok.token_ids)
        logprobs = [dict(zip(lp.token_ids, lp.logprobs, strict=True)) for lp in out.new_logprobs][
            : len(new_tokens)
        ]
        completion = CompletionOutput(
            index=0,
            text=detok.get_next_output_text(done, delta=True),
            token_ids=new_tokens,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs or None,
        )
        output = RequestOutput(
            request_id=out.request_id,
            prompt=None,
            prompt_token_ids=stream.prompt_token_ids,
            outputs=[completion],
            finished=done,
            metrics=m,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=prompt_logprobs_of(out.prompt_logprobs),
        )
        return output, stop is not None and not finished

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        for stream in self._streams.values():
            stream.finished = True
            stream.queue.put_nowait(EngineDeadError(reason))

    # ---- utilities ----------------------------------------------------------------------------
    async def get_stats(self) -> dict[str, float]:
        self._ensure_started()
        return await self.client.call_utility("get_stats")

    async def reset_prefix_cache(self) -> bool:
        self._ensure_started()
        return await self.client.call_utility("reset_prefix_cache")

    def processes(self) -> list[ProcessInfo]:
        return self.client.processes()

    def shutdown(self) -> None:
        self.client.shutdown()
