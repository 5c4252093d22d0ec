"""What `LLM` and `AsyncLLM` share in the API process (stages 1-2 and 9-10): the checkpoint, the
tokenizer, the input and output processors, the engine-core client, and every request in flight.

vLLM's `LLMEngine` and `AsyncLLM` each hold the same three parts (an input processor, an output
processor, an engine-core client); here they are assembled once. A request in flight is one
`InFlight`: its `ParentRequest` (n > 1 fans out into children), each child's `RequestState`
(detokenizer, metrics, and the span that records its DP rank) and, for a stream, the queue its
outputs go to. It is registered by `track` and dropped by `release`, which ends the children's
spans; a finished child's span ends once its last output has been handed to the caller
(`delivered`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from stepscope.engine.config import EngineConfig
from stepscope.engine.frontend.input_processor import InputProcessor, PromptType
from stepscope.engine.frontend.output_processor import OutputProcessor, RequestState
from stepscope.engine.frontend.parallel_sampling import ParentRequest
from stepscope.engine.models.config import read_model_shape
from stepscope.engine.models.loader import (
    load_generation_config,
    load_tokenizer,
    resolve_config,
    resolve_model,
)
from stepscope.engine.outputs import RequestOutput
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names
from stepscope.traces.run_spans import run_span


@dataclass(slots=True)
class InFlight:
    """One caller's request, from `track` to `release`."""

    parent: ParentRequest
    states: list[RequestState]  # one per child, in child order
    queue: Any = None  # AsyncLLM: where its children's outputs go (an asyncio.Queue)


class Frontend:
    """The API process's half of the engine, for one offline or one serving entry point."""

    def __init__(
        self,
        config: EngineConfig,
        make_client: Callable[[EngineConfig, Path], Any],
        *,
        model_name: str | None = None,
    ) -> None:
        self.model_dir = resolve_model(config.model_config.model)
        # A checkpoint this engine cannot run is refused here, before any process starts.
        shape = read_model_shape(self.model_dir, config.parallel_config.tensor_parallel_size)
        # dtype and quantization "auto" become this machine's choice once, here; every process
        # runs it.
        self.config = resolve_config(config, self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir, self.config.model_config.tokenizer)
        self.client = make_client(self.config, self.model_dir)
        self.processor = InputProcessor(
            self.tokenizer,
            self.client.max_model_len,
            shape.vocab_size,
            load_generation_config(self.model_dir),
        )
        self.output_processor = OutputProcessor(
            self.tokenizer,
            model_name or config.model_config.model,
            server=not config.offline,
            trace_content=config.observability_config.trace_content,
            block_size=config.cache_config.block_size,
        )
        # The configuration this run resolved to, once, for `stepscope trace replay`.
        entry = names.ENTRY_OFFLINE if config.offline else names.ENTRY_SERVE
        run_span(msgspec.json.encode(self.config).decode(), entry)
        self.requests: dict[str, InFlight] = {}  # by parent request id
        self._of_child: dict[str, InFlight] = {}  # the same requests, by child request id

    # ---- requests -----------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float,
    ) -> ParentRequest:
        """Tokenize and validate one request (`FieldError`/`ValueError` on bad input), fanned
        out into its n children; nothing is tracked or sent yet."""
        token_ids = self.processor.tokenize(prompt)
        return ParentRequest(self.processor.process(request_id, token_ids, params, arrival_time))

    def track(self, parent: ParentRequest, *, queue: Any = None, **how: Any) -> InFlight:
        """Register a request and its children before they are sent: their states and spans
        (`how`: operation, stream, prompt, trace headers, as `OutputProcessor.add_request` takes
        them) and the queue for its outputs. A request id already in flight is refused."""
        ids = [parent.request_id, *parent.child_ids]
        if any(i in self.requests or i in self._of_child for i in ids):
            raise ValueError(f"request id {parent.request_id!r} is already in flight")
        states = [self.output_processor.add_request(child, **how) for child in parent.children]
        flight = InFlight(parent, states, queue)
        self.requests[parent.request_id] = flight
        self._of_child.update(dict.fromkeys(parent.child_ids, flight))
        return flight

    @staticmethod
    def sent_to(state: RequestState, dp_rank: int) -> None:
        """Record on a child's span the DP rank the client sent it to."""
        state.span.set_attribute(names.DP_RANK, dp_rank)

    def flight_of(self, child_id: str) -> InFlight | None:
        return self._of_child.get(child_id)

    def delivered(self, outputs: Iterable[RequestOutput]) -> None:
        """The caller has these outputs: end the span of each child whose last output it is."""
        for out in outputs:
            if out.finished:
                flight = self._of_child.get(out.request_id)
                if flight is not None:
                    flight.states[flight.parent.child_ids.index(out.request_id)].span.end()

    def release(self, request_id: str) -> list[str]:
        """Stop tracking a request (finished, failed or abandoned); end its spans. Returns its
        children still running in the engine core, which the caller aborts there."""
        flight = self.requests.pop(request_id, None)
        if flight is None:
            return []
        for child_id in flight.parent.child_ids:
            self._of_child.pop(child_id, None)
        running = [i for i in flight.parent.child_ids if i in self.output_processor.request_states]
        self.output_processor.abort_requests(running)
        for state in flight.states:
            state.span.end()  # a no-op for a span already ended
        return running

    def release_all(self) -> list[str]:
        """Release every request in flight (the caller failed, or the engine died)."""
        running: list[str] = []
        for request_id in list(self.requests):
            running += self.release(request_id)
        return running
