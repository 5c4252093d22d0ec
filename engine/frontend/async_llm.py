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
from functools import partial
from typing import Any

from stepscope.engine.config import DEFAULT_MODEL, Endpoints, EngineConfig
from stepscope.engine.engine_args import check_engine_kwargs
from stepscope.engine.frontend.core_client import AsyncMPClient
from stepscope.engine.frontend.engine_group import Attachment, EngineDeadError
from stepscope.engine.frontend.frontend import Frontend
from stepscope.engine.frontend.input_processor import PromptType
from stepscope.engine.frontend.parallel_sampling import ParentRequest
from stepscope.engine.messages import EngineCoreOutputs, ProcessInfo
from stepscope.engine.outputs import RequestOutput
from stepscope.engine.sampling_params import FieldError, SamplingParams
from stepscope.traces import names


class AsyncLLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        config: EngineConfig | None = None,
        endpoints: Endpoints | None = None,
        attach: Attachment | None = None,
        model_name: str | None = None,
        **engine_options: Any,
    ) -> None:
        """The engine a server runs: given a built `config` (serve, the launcher), or built
        here from `model` and the engine options (`max_num_seqs=...`; executor "mp" unless
        told). It starts its own engine cores, or, given `attach` from a launcher
        (several API servers), attaches to those as API server `client_index`, receiving at
        `output_addr`. `endpoints`: where the engine's processes send spans."""
        if config is None:
            check_engine_kwargs(engine_options)
            engine_options.setdefault("executor", "mp")
            config = EngineConfig.create(model=model, offline=False, **engine_options)
        elif engine_options:
            raise ValueError(f"engine options given beside a config: {sorted(engine_options)}")
        self.model_name = model_name or config.model_config.model

        self.frontend = Frontend(
            config,
            partial(AsyncMPClient, endpoints=endpoints, attach=attach),
            model_name=self.model_name,
        )
        self.config = self.frontend.config
        self.client: AsyncMPClient = self.frontend.client
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
        parent = self.frontend.make_request(request_id, prompt, sampling_params, arrival_time)
        return self._generate(parent, operation, trace_headers)

    async def _generate(
        self, parent: ParentRequest, operation: str, trace_headers: Mapping[str, str] | None
    ) -> AsyncGenerator[RequestOutput, None]:
        self._ensure_started()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        # Each item on the queue is a list of its children's outputs from one step.
        flight = self.frontend.track(
            parent, operation=operation, stream=True, trace_headers=trace_headers,
            queue=asyncio.Queue(),
        )  # fmt: skip
        try:
            for child, state in zip(parent.children, flight.states, strict=True):
                with state.span.current():
                    self.frontend.sent_to(state, await self.client.add_request(child))
            while True:
                item = await flight.queue.get()
                if isinstance(item, BaseException):
                    raise item
                merged = parent.merge(item)
                yield merged
                self.frontend.delivered(item)
                if merged.finished:
                    return
        finally:
            await self._forget(parent.request_id)

    async def abort(self, request_id: str) -> None:
        await self._forget(request_id)

    async def _forget(self, request_id: str) -> None:
        """Stop tracking a request; abort its engine-core requests still running."""
        running = self.frontend.release(request_id)
        if running:
            await self.client.abort_requests(running)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        processed = self.frontend.output_processor.process_outputs(outputs.outputs)
        batches: dict[int, tuple[asyncio.Queue, list[RequestOutput]]] = {}
        for out in processed.request_outputs:
            flight = self.frontend.flight_of(out.request_id)
            if flight is not None:
                batches.setdefault(id(flight), (flight.queue, []))[1].append(out)
        for queue, batch in batches.values():
            queue.put_nowait(batch)
        if processed.reqs_to_abort:
            asyncio.get_running_loop().create_task(
                self.client.abort_requests(processed.reqs_to_abort)
            )

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        self.frontend.output_processor.abort_requests(
            list(self.frontend.output_processor.request_states)
        )
        for flight in self.frontend.requests.values():
            flight.queue.put_nowait(EngineDeadError(reason))

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

    # ---- the tokenizer and the checkpoint's defaults, for the HTTP routes ----------------------
    @property
    def default_sampling(self) -> dict[str, Any]:
        """The checkpoint's sampling values (generation_config.json) for a request that leaves
        them unset."""
        return self.frontend.processor.default_sampling

    def get_tokenizer(self) -> Any:
        """The tokenizer, for the response builders that turn token ids into text."""
        return self.frontend.tokenizer

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.frontend.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """A chat's prompt ids, as a chat request sends them to the engine."""
        return self.frontend.processor.apply_chat_template(messages)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`; an id outside the vocabulary raises `FieldError("tokens")`."""
        vocab = self.frontend.processor.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise FieldError("tokens", f"tokens must be token ids in [0, {vocab})")
        return self.frontend.tokenizer.decode(token_ids)

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's class, special tokens, chat template and sizes (vLLM's
        /tokenizer_info)."""
        tok = self.frontend.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
            "model_max_length": self.max_model_len,
            "vocab_size": self.frontend.processor.vocab_size,
        }
