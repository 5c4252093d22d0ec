"""Output processing in the API process: engine-core outputs become `RequestOutput`s (stages 9-10).

One `OutputProcessor` serves every client, as vLLM's does: `LLM` asks for each request's whole
output once it finishes, `AsyncLLM` for the increments of a stream. Per request it keeps the
incremental detokenizer (which finds stop strings), the `RequestMetrics` and the
`stepscope.request` span. A stop string is found here, not in the engine core, so
`process_outputs` also says which requests the caller must abort there.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from stepscope.engine.frontend.detokenizer import IncrementalDetokenizer
from stepscope.engine.messages import EngineCoreOutput, EngineCoreRequest
from stepscope.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    prompt_logprobs_of,
)
from stepscope.traces import names
from stepscope.traces.names import RequestEvent
from stepscope.traces.spans import request_span

PromptLogprobs = list[dict[int, float] | None]


@dataclass(slots=True)
class RequestState:
    """One request between the engine core and its caller."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    span: Any  # the request's `stepscope.request` span (a no-op when tracing is off)
    stream: bool  # True: an output per step with what is new; False: one whole output at the end
    num_sent_tokens: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Requests a stop string ended here that the engine core is still running.
    reqs_to_abort: list[str]


class OutputProcessor:
    """Detokenizes, stops on stop strings, times and traces every request in flight."""

    def __init__(
        self,
        tokenizer: Any,
        model: str,
        *,
        server: bool = True,
        trace_content: bool = False,
        block_size: int = 16,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.server = server  # request spans are SERVER spans in a server, INTERNAL offline
        # The prompt and the generated text on the request span (`--trace-content`, opt-in).
        self.trace_content = trace_content
        self.block_size = block_size  # the KV block size the prompt's block hashes are taken at
        self.request_states: dict[str, RequestState] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        *,
        operation: str,
        stream: bool,
        prompt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestState:
        """Track a request before it is sent; send it inside `state.span.current()`. Its span
        is ended by the caller (frontend.py) once its last output is delivered."""
        if request.request_id in self.request_states:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        params = request.sampling_params
        span = request_span(
            request.request_id,
            model=self.model,
            operation=operation,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            input_tokens=len(request.prompt_token_ids),
            headers=trace_headers,
            server=self.server,
            start_ns=int(request.arrival_time * 1e9),
            input_value=self._prompt_text(request, prompt) if self.trace_content else None,
        )
        if span.recording:  # what a replay needs; hashing costs a few microseconds per block
            span.record_prompt(
                request.prompt_token_ids,
                self.block_size,
                msgspec.json.encode(msgspec.structs.asdict(params)).decode(),
                content=self.trace_content,
            )
        state = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            span=span,
            stream=stream,
        )
        self.request_states[request.request_id] = state
        return state

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Forget requests that end before they finish (the client left, the engine died)."""
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                state.span.finish(finish_reasons=["abort"], output_value=self._output_text(state))

    def process_outputs(self, engine_core_outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        """Take in one step's outputs; outputs of requests not in flight are ignored."""
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            if out.long_wait is not None:  # a notice, no tokens: onto the span, not to the caller
                state.span.event(
                    RequestEvent.LONG_WAIT, out.events.get(RequestEvent.LONG_WAIT), _long_wait(out)
                )
                continue
            stopped_here = self._update(state, out)
            if stopped_here:
                reqs_to_abort.append(out.request_id)
            finished = state.finish_reason is not None
            if finished:
                del self.request_states[out.request_id]
            if state.stream:
                request_outputs.append(self._delta_output(state, out))
            elif finished:
                request_outputs.append(self._final_output(state))
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    def _update(self, state: RequestState, out: EngineCoreOutput) -> bool:
        """Fold one output into the state; True when a stop string ended the request here."""
        metrics = state.metrics
        metrics.update(out.events, out.num_cached_tokens, out.num_preemptions)
        state.span.observe(out)
        if out.prompt_logprobs:
            state.prompt_logprobs = prompt_logprobs_of(out.prompt_logprobs)
        finished = out.finish_reason is not None
        detok = state.detokenizer
        num_before = len(detok.token_ids)
        # The engine core stops a request with reason "stop" only at an eos or stop token id
        # (stop strings are found here).
        stop = detok.update(out.new_token_ids, finished, stop_token=out.finish_reason == "stop")
        # Tokens after a stop string are dropped, and so are their logprobs.
        num_new = len(detok.token_ids) - num_before
        if not state.stream:
            state.logprobs.extend(_logprobs(out)[:num_new])
        if stop is not None:
            state.finish_reason, state.stop_reason = "stop", stop
        elif finished:
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
        if state.finish_reason is not None:
            metrics.finished_time = out.events.get(RequestEvent.FINISHED, time.time())
            state.span.finish(
                output_tokens=len(detok.token_ids),
                finish_reasons=[state.finish_reason],
                output_value=self._output_text(state),
            )
        return stop is not None and not finished

    def _prompt_text(self, request: EngineCoreRequest, prompt: str | None) -> str:
        """The prompt as given, else as the model saw it (a chat after its template)."""
        if prompt is not None:
            return prompt
        return self.tokenizer.decode(request.prompt_token_ids)

    def _output_text(self, state: RequestState) -> str | None:
        """The whole text generated so far, for the span; None unless `trace_content`."""
        return state.detokenizer.output_text if self.trace_content else None

    def _delta_output(self, state: RequestState, out: EngineCoreOutput) -> RequestOutput:
        """What this output added: new text, token ids and logprobs."""
        detok = state.detokenizer
        finished = state.finish_reason is not None
        new_tokens = detok.token_ids[state.num_sent_tokens :]
        state.num_sent_tokens = len(detok.token_ids)
        logprobs = _logprobs(out)[: len(new_tokens)]
        text = detok.get_next_output_text(finished, delta=True)
        return _request_output(
            state, text, new_tokens, logprobs, finished, out.num_cached_tokens,
            prompt_logprobs_of(out.prompt_logprobs),
        )  # fmt: skip

    def _final_output(self, state: RequestState) -> RequestOutput:
        """The whole output of a finished request."""
        detok = state.detokenizer
        return _request_output(
            state, detok.output_text, detok.token_ids, state.logprobs, True,
            state.metrics.num_cached_tokens, state.prompt_logprobs,
        )  # fmt: skip


def _request_output(
    state: RequestState,
    text: str,
    token_ids: list[int],
    logprobs: list[dict[int, float]] | None,
    finished: bool,
    num_cached_tokens: int,
    prompt_logprobs: list | None,
) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=token_ids,
        finish_reason=state.finish_reason,
        stop_reason=state.stop_reason,
        logprobs=logprobs or None,
    )
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[completion],
        finished=finished,
        metrics=state.metrics,
        num_cached_tokens=num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
    )


def _long_wait(out: EngineCoreOutput) -> dict[str, Any]:
    """The `long_wait` event's attributes (names.RequestEvent.LONG_WAIT)."""
    lw = out.long_wait
    attributes: dict[str, Any] = {names.WAITING_REASON: lw.reason, names.WAITED_S: lw.waited_s}
    if lw.reason == "kv_blocks":
        attributes[names.KV_BLOCKS_SHORT] = lw.kv_blocks_short
    return attributes


def _logprobs(out: EngineCoreOutput) -> list[dict[int, float]]:
    return [dict(zip(lp.token_ids, lp.logprobs, strict=True)) for lp in out.new_logprobs]
