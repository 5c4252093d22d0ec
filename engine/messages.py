"""Every message that crosses a boundary of the request path, as msgspec structs (stages 2, 5, 7
and 9 of docs/request-path.md).

| boundary                  | message             |
|---------------------------|---------------------|
| API -> engine core        | EngineCoreRequest   |
| engine core -> worker     | SchedulerOutput     |
| worker -> engine core     | ModelRunnerOutput   |
| engine core -> API        | EngineCoreOutputs   |

Workers get diffs, not whole batches: a request's tokens and sampling parameters cross once, in
`NewRequestData`; afterwards only its new block ids and token counts do. Below the four messages:
the frame kinds and addresses of the engine core's sockets and of its workers'.
"""

from __future__ import annotations

from typing import Any

import msgspec

from stepscope.engine.config import Endpoints, EngineConfig
from stepscope.engine.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    trace_context: dict[str, str] = {}  # W3C context of the sender's span (see traces/)
    client_index: int = 0  # which API server sent it: its outputs go back there


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the worker has not seen (or must forget and rebuild after a preemption)."""

    req_id: str
    token_ids: list[int]  # prompt, plus tokens generated before a preemption
    sampling_params: SamplingParams
    block_ids: list[int]  # its block table in KV cache group 0 (the only one, in most models)
    num_computed_tokens: int
    num_prompt_tokens: int = 0  # of token_ids, the prompt (for prompt logprobs)
    # A hybrid model's other KV cache groups (1, 2, ..): each one's block table.
    group_block_ids: list[list[int]] = []

    def block_ids_by_group(self) -> list[list[int]]:
        return [self.block_ids, *self.group_block_ids]


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Per-step diff for requests the worker already holds."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []  # per request, its new blocks in KV cache group 0
    num_computed_tokens: list[int] = []
    # A hybrid model's other groups: per request, per group 1, 2, .., its new blocks.
    new_group_block_ids: list[list[list[int]]] = []

    def new_block_ids_by_group(self, i: int) -> list[list[int]]:
        """The new blocks of the i-th request in every group."""
        more = self.new_group_block_ids[i] if self.new_group_block_ids else []
        return [self.new_block_ids[i], *more]


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Exactly what one step is: which requests run, with how many tokens each."""

    step: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]  # finished or aborted since the last step: drop their state
    preempted_req_ids: list[str]  # preempted this step: drop their state
    trace_context: dict[str, str] = {}
    # Structured outputs (vLLM's GrammarOutput): for each request id here, in order, one row of
    # ceil(vocab / 32) little-endian int32 words, bit j of word w set where token 32 w + j is
    # allowed next. Empty when no structured request samples in this step.
    structured_output_request_ids: list[str] = []
    grammar_bitmask: bytes = b""


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of a run of prompt tokens, each given the tokens before it (one chunk's worth)."""

    start: int  # prompt position of the first token scored (>= 1: the first has no context)
    token_ids: list[list[int]]  # per position: the prompt's token, then the top-N
    logprobs: list[list[float]]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sampled tokens of one step, one list per scheduled request (empty mid-prefill)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request with logprobs asked: [sampled, top-1, ..., top-N] ids and their logprobs.
    logprob_token_ids: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    # Per request with prompt logprobs asked, for the prompt tokens this step computed.
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    trace_context: dict[str, str] = {}


class Logprob(msgspec.Struct, array_like=True):
    token_ids: list[int]  # the sampled token first, then the top-N
    logprobs: list[float]


class LongWait(msgspec.Struct, array_like=True):
    """The engine core's word that a request has waited past `long_wait_warning_s`."""

    waited_s: float  # since it was queued, or since its last preemption
    reason: str  # why the head of the waiting queue was held back (`StepStats.waiting_reason`)
    kv_blocks_short: int = 0  # with "kv_blocks": how many free blocks the head lacked


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step: token ids, never text. With `long_wait` it is a
    notice only (no tokens; `events` holds `long_wait`), which the API side puts on the span."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    new_logprobs: list[Logprob] = []
    num_cached_tokens: int = 0
    events: dict[str, float] = {}  # time.time() by `traces.names.RequestEvent`
    num_preemptions: int = 0
    # With the first token: one Logprob per prompt position from 1 on (prompt token first).
    prompt_logprobs: list[Logprob] = []
    long_wait: LongWait | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    trace_context: dict[str, str] = {}


# ---- the engine-core process: request kinds in, message kinds out ----
class RequestKind:
    """First frame of every message sent to the engine core."""

    ADD = b"add"  # EngineCoreRequest
    ABORT = b"abort"  # list[str] of request ids
    UTILITY = b"utility"  # UtilityRequest
    SHUTDOWN = b"shutdown"


class OutputKind:
    """First frame of every message the engine core sends back."""

    OUTPUTS = b"outputs"  # EngineCoreOutputs
    UTILITY = b"utility"  # UtilityResult
    READY = b"ready"  # EngineCoreReady
    DEAD = b"dead"  # EngineDead


class UtilityRequest(msgspec.Struct, array_like=True):
    call_id: int
    method: str  # one of ENGINE_CORE_UTILITY_METHODS
    args: list = []
    client_index: int = 0  # the API server to answer


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class ProcessInfo(msgspec.Struct, array_like=True):
    role: str  # "api", "dp_coordinator", "engine_core", "worker"
    rank: int  # api: server index; engine_core: DP rank; worker: TP rank
    pid: int
    dp_rank: int = 0  # the data-parallel rank a core or worker serves


class RankLoad(msgspec.Struct, array_like=True):
    """An engine core's queue, as it tells the DP coordinator after a step that changed it."""

    dp_rank: int
    num_waiting: int
    num_running: int


class EngineCoreReady(msgspec.Struct, array_like=True):
    """An engine core's handshake, once its model and KV pool are ready."""

    num_kv_blocks: int
    max_model_len: int
    processes: list[ProcessInfo]
    dp_rank: int = 0
    input_addr: str = ""  # where the core listens for requests (every API server connects)


class CoreAddresses(msgspec.Struct, array_like=True):
    """The launcher's answer to a ready engine core: where to send what."""

    output_addrs: list[str]  # one per API server, by client index
    coordinator_addr: str | None = None  # with DP > 1: where to send RankLoad
    # With ranks on other machines: the coordinator's publications over TCP. Engine cores there
    # watch the head by them (a head silent for liveness.HEAD_TIMEOUT_S is gone: they stop).
    head_addr: str | None = None


class EngineDead(msgspec.Struct, array_like=True):
    reason: str


class CoreProcArgs(msgspec.Struct):
    """What a new engine-core process reads from its stdin at start."""

    config: EngineConfig  # this DP rank's copy (EngineConfig.for_dp_rank)
    endpoints: Endpoints
    model_dir: str
    handshake_addr: str  # the launcher's ROUTER: READY or DEAD goes there, CoreAddresses back
    input_bind: str  # where to listen: an ipc path, or "tcp://HOST:*" for any free port
    parent_pid: int


# ---- the worker processes: what the engine core broadcasts, what its workers reply ----
class WorkerRequestKind:
    """First frame of every message the engine core broadcasts to its workers (the second is
    the msgpack payload)."""

    STEP = b"step"  # SchedulerOutput
    CALL = b"call"  # (method, args): one of WORKER_UTILITY_METHODS, answered by every rank
    STOP = b"stop"


# Utility calls: the methods a client may call on an engine core (`EngineCore`), and the engine
# core on every worker rank (`Worker`); anything else is refused by name. One dispatch,
# `call_utility`, serves the engine-core process, the in-process client and the workers.
ENGINE_CORE_UTILITY_METHODS = frozenset(
    {"get_stats", "reset_prefix_cache", "flush_traces", "get_config"}
)
WORKER_UTILITY_METHODS = frozenset(
    {"determine_num_kv_blocks", "init_kv_cache", "flush_traces", "get_config"}
)


def call_utility(target: Any, allowed: frozenset[str], method: str, args: tuple | list) -> Any:
    """`target.method(*args)` where `method` is in `allowed`; ValueError otherwise."""
    if method not in allowed:
        raise ValueError(f"unknown utility method {method!r}")
    return getattr(target, method)(*args)


class WorkerReplyKind:
    """First frame of every message to the engine core's reply socket; the second is msgpack
    (rank, seconds), the third the payload."""

    READY = b"ready"  # the worker's pid
    OUTPUT = b"output"  # ModelRunnerOutput, rank 0 only; seconds = time inside execute_model
    RESULT = b"result"  # a utility call's result
    ERROR = b"error"  # start-up or step exception text; the worker then exits
    # A worker machine's `run_worker_node`, every liveness.WORKER_NODE_HEARTBEAT_S; rank = node.
    HEARTBEAT = b"beat"


class WorkerAddresses(msgspec.Struct, array_like=True):
    """Where the workers of one engine core meet it and each other."""

    bcast: str  # the core's XPUB: steps and calls out to every rank
    results: str  # the core's PULL: outputs, results, errors (and other machines' heartbeats)
    dist_init: str  # torch.distributed's TCP rendezvous
