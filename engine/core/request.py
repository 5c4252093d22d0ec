"""A request as the engine core sees it: token ids, progress and status (stages 3 to 8).

The scheduler tracks each request by two numbers: `num_computed_tokens` (tokens whose KV is in
the cache) and `num_tokens` (prompt + generated). Each step adds tokens so the first catches up;
under async scheduling it catches up with `num_tokens + num_output_placeholders` (tokens sampled by
steps still in flight).
"""

from __future__ import annotations

import enum
import hashlib
import struct
import time
from dataclasses import dataclass, field

from stepscope.engine.core.structured_output import StructuredOutputRequest
from stepscope.engine.messages import Logprob
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces.names import RequestEvent


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Queued, but its grammar is still compiling: the scheduler skips it (vLLM's WAITING_FOR_FSM).
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained hash of one full block: the parent block's hash plus this block's token ids."""
    data = struct.pack(f"{len(token_ids)}q", *token_ids)
    return hashlib.sha256((parent or b"") + data).digest()[:16]


@dataclass(slots=True)
class RequestEvents:
    """Wall-clock times (time.time()) of the moments a request passes through the engine core."""

    queued: float = 0.0  # when the engine core received the request
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    preempted: list[float] = field(default_factory=list)
    # When its grammar was ready (compiled, or found compiled) for a structured request: the
    # queue time before it is the `grammar` reason of `trace explain`.
    grammar_ready: float | None = None

    def report(self, now: float, first_tokens: bool, finished: bool) -> dict[str, float]:
        """The events one `EngineCoreOutput` carries: the timeline up to the first token with a
        request's first tokens, `finished` (and its last preemption) with its last."""
        events: dict[str, float] = {}
        if first_tokens:
            events[RequestEvent.QUEUED] = self.queued
            if self.first_scheduled is not None:
                events[RequestEvent.SCHEDULED] = self.first_scheduled
            if self.grammar_ready is not None:
                events[RequestEvent.GRAMMAR_READY] = self.grammar_ready
            events[RequestEvent.FIRST_TOKEN] = now
        if finished:
            events[RequestEvent.FINISHED] = now
            if self.preempted:
                events[RequestEvent.PREEMPTED] = self.preempted[-1]
        return events


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_size: int
    arrival_time: float = field(default_factory=time.time)  # when the API process got it
    queued_time: float | None = None  # when the engine core got it (default: arrival_time)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens that steps already scheduled will sample but that have not come back yet: one while
    # a sampling step runs, two for a moment under async scheduling, which schedules the next
    # step before the last one's token is known (the worker feeds that token from its own sample).
    num_output_placeholders: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Prompt tokens found in the prefix cache at first admission (-1 until admitted).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    events: RequestEvents = field(init=False)
    # Prompt logprobs gathered from the steps that computed the prompt, sent with the first token.
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    # The grammar its output must follow (compiling, or ready with its matcher); None: free text.
    structured_output: StructuredOutputRequest | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.structured_output is not None:
            self.status = RequestStatus.WAITING_FOR_GRAMMAR
        queued = self.arrival_time if self.queued_time is None else self.queued_time
        self.events = RequestEvents(queued=queued)
        self._update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 1 << 62

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        bs = self.block_size
        for start in range(len(self.block_hashes) * bs, self.num_tokens - bs + 1, bs):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, self.all_token_ids[start : start + bs]))

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
