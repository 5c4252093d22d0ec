"""`AsyncLLM`: the API process's engine (stages 1-2 and 9-10 around an engine-core process).

It tokenizes and validates requests, sends them to the engine core over ZMQ, and turns the token
ids that come back into text with the `OutputProcessor` that `LLM` uses too. `generate()` is an
async iterator of incremental outputs: each item carries the text and token ids produced since
the previous one. Closing the iterator early (a client that went away) aborts the request.
A request with `n` > 1 fans out here into n engine-core requests (`ParentRequest`), as in vLLM.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from stepscope.engine.config import EngineConfig
from stepscope.engine.frontend.core_client import AsyncMPClient
from stepscope.engine.frontend.engine_group import EngineDeadError, EngineHandles
from stepscope.engine.frontend.input_processor import InputProcessor, PromptType
from stepscope.engine.frontend.output_processor import OutputProcessor
from stepscope.engine.frontend.parallel_sampling import ParentRequest
from stepscope.engine.messages import EngineCoreOutputs, ProcessInfo
from stepscope.engine.models.config import read_model_shape
from stepscope.engine.models.loader import (
    DEFAULT_MODEL,
    load_generation_config,
    load_tokenizer,
    resolve_model,
)
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
        # A checkpoint this engine cannot run is refused here, before any process starts.
        shape = read_model_shape(self.model_dir, self.config.tensor_parallel_size)
        self.config.resolve_dtype(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.client = AsyncMPClient(
            self.config,
            self.model_dir,
            handles=engine_handles,
            client_index=client_index,
            output_addr=output_addr,
        )
        self.processor = InputProcessor(
            self.tokenizer,
            self.client.max_model_len,
            shape.vocab_size,
            load_generation_config(self.model_dir),
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, model, trace_content=self.config.trace_content
        )
        # Each engine-core request's outputs, waiting for its caller: children of one request
        # share their parent's queue, and each item is a list of their outputs from one step.
        self._queues: dict[str, asyncio.Queue] = {}
        self._parents: dict[str, ParentRequest] = {}  # requests in flight, by request id
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
    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        operation: str = names.OPERATION_TEXT_COMPLETION,
        trace_headers: Mapping[str, str] | None = None,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Incremental outputs of one request. `trace_headers` (an incoming W3C `traceparent`)
        become the parent of the request's span; `arrival_time` (default: now) is when the
        request came in, before its prompt was tokenized.

        The prompt is tokenized and the request validated by this call, before anything is sent
        or yielded: bad input raises `FieldError` here (a server answers 400 before it starts a
        stream). The request enters the engine when the iteration starts.

        Each output holds a `CompletionOutput` for every sequence that advanced in one engine
        step, at its index: with `n` > 1, up to n of them (index 0..n-1, in index order, each
        sequence's metrics at the same place in `children_metrics`); the last output is
        `finished`, once every sequence has finished."""
        if arrival_time is None:
            arrival_time = time.time()
        token_ids = self.processor.tokenize(prompt)
        request = self.processor.process(request_id, token_ids, sampling_params, arrival_time)
        return self._generate(ParentRequest(request), operation, trace_headers)

    async def _generate(
        self, parent: ParentRequest, operation: str, trace_headers: Mapping[str, str] | None
    ) -> AsyncGenerator[RequestOutput, None]:
        self._ensure_started()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if parent.request_id in self._parents or any(i in self._queues for i in parent.child_ids):
            raise ValueError(f"request id {parent.request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.update(dict.fromkeys(parent.child_ids, queue))
        self._parents[parent.request_id] = parent
        spans: dict[str, Any] = {}  # each child's `stepscope.request` span
        try:
            for child in parent.children:
                state = self.output_processor.add_request(
                    child, operation=operation, stream=True, trace_headers=trace_headers
                )
                spans[child.request_id] = state.span
                with state.span.current():
                    state.span.set_attribute(names.DP_RANK, await self.client.add_request(child))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                merged = parent.merge(item)
                yield merged
                for out in item:
                    if out.finished:
                        spans[out.request_id].end()  # its last output is out
                if merged.finished:
                    return
        finally:
            await self._forget(parent.request_id, parent.child_ids)
            for span in spans.values():
                span.end()

    async def abort(self, request_id: str) -> None:
        parent = self._parents.get(request_id)
        await self._forget(request_id, parent.child_ids if parent else [request_id])

    async def _forget(self, request_id: str, child_ids: list[str]) -> None:
        """Stop tracking a request; abort its engine-core requests still running."""
        self._parents.pop(request_id, None)
        for child_id in child_ids:
            self._queues.pop(child_id, None)
        running = [i for i in child_ids if i in self.output_processor.request_states]
        if running:
            self.output_processor.abort_requests(running)
            await self.client.abort_requests(running)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        processed = self.output_processor.process_outputs(outputs.outputs)
        batches: dict[asyncio.Queue, list[RequestOutput]] = {}
        for out in processed.request_outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                batches.setdefault(queue, []).append(out)
        for queue, batch in batches.items():
            queue.put_nowait(batch)
        if processed.reqs_to_abort:
            asyncio.get_running_loop().create_task(
                self.client.abort_requests(processed.reqs_to_abort)
            )

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        self.output_processor.abort_requests(list(self.output_processor.request_states))
        for queue in set(self._queues.values()):
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
