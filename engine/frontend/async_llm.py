"""`AsyncLLM`: the API process's engine (stages 1-2 and 9-10 around an engine-core process).

It tokenizes and validates requests, sends them to the engine core over ZMQ, and turns the token
ids that come back into text with the `OutputProcessor` that `LLM` uses too. `generate()` is an
async iterator of incremental outputs: each item carries the text and token ids produced since
the previous one. Closing the iterator early (a client that went away) aborts the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from stepscope.engine.config import EngineConfig
from stepscope.engine.frontend.core_client import AsyncMPClient, EngineDeadError, EngineHandles
from stepscope.engine.frontend.input_processor import InputProcessor, PromptType
from stepscope.engine.frontend.output_processor import OutputProcessor
from stepscope.engine.messages import EngineCoreOutputs, ProcessInfo
from stepscope.engine.models.loader import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from stepscope.engine.outputs import RequestOutput
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names


class AsyncLLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        engine_handles: EngineHandles | None = None,
        client_index: int = 0,
        output_addr: str | None = None,
        **engine_args: Any,
    ) -> None:
        """Starts its own engine cores, or, given `engine_handles` from a launcher (several API
        servers), attaches to those as API server `client_index`, receiving at `output_addr`."""
        engine_args.setdefault("executor", "mp")
        self.config = EngineConfig(model=model, offline=False, **engine_args)
        self.model_name = model
        self.model_dir = resolve_model(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.client = AsyncMPClient(
            self.config,
            self.model_dir,
            handles=engine_handles,
            client_index=client_index,
            output_addr=output_addr,
        )
        self.processor = InputProcessor(
            self.tokenizer, self.client.max_model_len, load_config(self.model_dir)["vocab_size"]
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, model, trace_content=self.config.trace_content
        )
        self._queues: dict[str, asyncio.Queue] = {}  # each request's outputs, waiting for it
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
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs of one request. `trace_headers` (an incoming W3C `traceparent`)
        become the parent of the request's span; `arrival_time` (default: now) is when the
        request came in, before its prompt was tokenized."""
        if arrival_time is None:
            arrival_time = time.time()
        self._ensure_started()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        token_ids = self.processor.tokenize(prompt)
        request = self.processor.process(request_id, token_ids, sampling_params, arrival_time)
        state = self.output_processor.add_request(
            request, operation=operation, stream=True, trace_headers=trace_headers
        )
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            with state.span.current():
                state.span.set_attribute(names.DP_RANK, await self.client.add_request(request))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if request_id in self.output_processor.request_states:
                self.output_processor.abort_requests([request_id])
                await self.client.abort_requests([request_id])
            state.span.end()  # the last output is out

    async def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.output_processor.abort_requests([request_id])
        await self.client.abort_requests([request_id])

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        processed = self.output_processor.process_outputs(outputs.outputs)
        for out in processed.request_outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if processed.reqs_to_abort:
            asyncio.get_running_loop().create_task(
                self.client.abort_requests(processed.reqs_to_abort)
            )

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        self.output_processor.abort_requests(list(self.output_processor.request_states))
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))

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
