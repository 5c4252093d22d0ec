"""What the user gets back: `RequestOutput` with its completions and timing (stage 10)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stepscope.traces.names import RequestEvent


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's path through the engine."""

    arrival_time: float  # the API process got the request (before tokenizing it)
    queued_time: float | None = None  # the engine core got it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def update(
        self, events: dict[str, float], num_cached_tokens: int, num_preemptions: int
    ) -> None:
        """Take in what one EngineCoreOutput says about the request's timeline."""
        self.queued_time = events.get(RequestEvent.QUEUED, self.queued_time)
        self.first_scheduled_time = events.get(RequestEvent.SCHEDULED, self.first_scheduled_time)
        self.first_token_time = events.get(RequestEvent.FIRST_TOKEN, self.first_token_time)
        self.num_cached_tokens = num_cached_tokens
        self.num_preemptions = num_preemptions

    @property
    def queue_time(self) -> float | None:
        """Time in the engine core's waiting queue before first being scheduled (stage 3)."""
        if self.first_scheduled_time is None:
            return None
        queued = self.arrival_time if self.queued_time is None else self.queued_time
        return self.first_scheduled_time - queued

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # One dict per generated token: {token_id: logprob} for the sampled token and the top-N.
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    children_metrics: list[RequestMetrics] = field(default_factory=list)
    # With SamplingParams(prompt_logprobs=N): None for the first prompt token (it has no
    # context), then {token_id: logprob} for the prompt's token and the top-N at each position.
    prompt_logprobs: list[dict[int, float] | None] | None = None


def prompt_logprobs_of(logprobs: list) -> list[dict[int, float] | None] | None:
    """`RequestOutput.prompt_logprobs` from an EngineCoreOutput's `prompt_logprobs`."""
    if not logprobs:
        return None
    return [None, *(dict(zip(lp.token_ids, lp.logprobs, strict=True)) for lp in logprobs)]
