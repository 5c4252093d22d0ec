"""Every message that crosses a boundary of the request path, as msgspec structs (stage 5).

| boundary                  | message             |
|---------------------------|---------------------|
| API -> engine core        | EngineCoreRequest   |
| engine core -> worker     | SchedulerOutput     |
| worker -> engine core     | ModelRunnerOutput   |
| engine core -> API        | EngineCoreOutputs   |

Workers get diffs, not whole batches: a request's tokens and sampling parameters cross once, in
`NewRequestData`; afterwards only its new block ids and token counts do.
"""

from __future__ import annotations

import msgspec

from stepscope.engine.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the worker has not seen (or must forget and rebuild after a preemption)."""

    req_id: str
    token_ids: list[int]  # prompt, plus tokens generated before a preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Per-step diff for requests the worker already holds."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Exactly what one step is: which requests run, with how many tokens each."""

    step: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]  # finished or aborted since the last step: drop their state
    preempted_req_ids: list[str]  # preempted this step: drop their state


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sampled tokens of one step, one list per scheduled request (empty mid-prefill)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request with logprobs asked: [sampled, top-1, ..., top-N] ids and their logprobs.
    logprob_token_ids: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}


class Logprob(msgspec.Struct, array_like=True):
    token_ids: list[int]  # the sampled token first, then the top-N
    logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step: token ids, never text."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    new_logprobs: list[Logprob] = []
    num_cached_tokens: int = 0
    events: dict[str, float] = {}  # queued / scheduled / first_token / preempted / finished
    num_preemptions: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
