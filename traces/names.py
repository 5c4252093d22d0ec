"""Span names, attribute keys and boundary labels: the tracing contract of the request path.

The dashboard, the tutorials, the DuckDB views and outside tools read spans by these names, so
they are fixed here once and documented in docs/tracing.md. GenAI keys follow the OpenTelemetry
GenAI semantic conventions, messaging keys the messaging conventions, and the OpenInference keys
(span kind, `llm.*`, `input.*`, `output.*`) the OpenInference conventions that Phoenix reads.
"""

from __future__ import annotations

from enum import StrEnum

# ---- services (resource `service.name`, one per process kind) ------------------------------------
SERVICE_API = "stepscope.api"
SERVICE_ENGINE_CORE = "stepscope.engine_core"
SERVICE_WORKER = "stepscope.worker"
SERVICE_DP_COORDINATOR = "stepscope.dp_coordinator"  # with data parallelism: rank loads only
# Offline `LLM` with the in-process engine core: every role in one process, one provider.
SERVICE_OFFLINE = "stepscope.offline"
SERVICE_NAME = "service.name"
PROCESS_PID = "process.pid"  # resource attribute: the collector counts each sender's spans by it
RANK = "stepscope.rank"  # resource attribute of workers, and attribute of worker_step spans
# Resource attribute of engine cores and workers (their data-parallel rank), and attribute of a
# request span (the rank it was sent to) and of the API side's crossings for it.
DP_RANK = "stepscope.dp_rank"

# ---- span names ----------------------------------------------------------------------------------
REQUEST = "stepscope.request"  # API process: root per request
ENGINE_STEP = "stepscope.engine_step"  # engine core: one per step
SCHEDULE = "stepscope.schedule"  # children of ENGINE_STEP
EXECUTE = "stepscope.execute"
UPDATE = "stepscope.update"
# Engine core: building the grammar bitmask of the structured requests that sample in the step
# (a child of ENGINE_STEP, only in steps that have one).
GRAMMAR_BITMASK = "stepscope.grammar_bitmask"
WORKER_STEP = "stepscope.worker_step"  # worker: one per worker per step
PREPARE_INPUTS = "stepscope.prepare_inputs"  # children of WORKER_STEP
FORWARD = "stepscope.forward"
SAMPLE = "stepscope.sample"
# Worker: masking the logits with the step's grammar bitmask (a child of SAMPLE, only in steps
# that carry one).
APPLY_GRAMMAR_BITMASK = "stepscope.apply_grammar_bitmask"
SEND = "stepscope.send"  # PRODUCER on the sender of a message across a boundary
RECEIVE = "stepscope.receive"  # CONSUMER on the receiver, parented on the SEND span
DP_PUBLISH = "stepscope.dp_publish"  # DP coordinator: one per publication of the ranks' loads
RUN = "stepscope.run"  # API process: once as a front end (LLM, AsyncLLM) starts; its config
# Whoever starts the engine cores (the API process, or the launcher): from the first process (or
# the Ray cluster) asked for to the last DP rank's READY.
ENGINE_START = "stepscope.engine_start"
# A child of ENGINE_START per engine core (started to READY) and per worker (started to its
# ready reply, recorded by its engine core under the context the core was started with).
PROCESS_START = "stepscope.process_start"

SPAN_NAMES = (
    REQUEST,
    ENGINE_STEP,
    SCHEDULE,
    EXECUTE,
    UPDATE,
    GRAMMAR_BITMASK,
    WORKER_STEP,
    PREPARE_INPUTS,
    FORWARD,
    SAMPLE,
    APPLY_GRAMMAR_BITMASK,
    SEND,
    RECEIVE,
    DP_PUBLISH,
    RUN,
    ENGINE_START,
    PROCESS_START,
)

# ---- the four boundaries of the request path -----------------------------------------------------
API_TO_ENGINE_CORE = "api->engine_core"  # EngineCoreRequest
ENGINE_CORE_TO_WORKER = "engine_core->worker"  # SchedulerOutput
WORKER_TO_ENGINE_CORE = "worker->engine_core"  # ModelRunnerOutput
ENGINE_CORE_TO_API = "engine_core->api"  # EngineCoreOutputs
BOUNDARIES = (API_TO_ENGINE_CORE, ENGINE_CORE_TO_WORKER, WORKER_TO_ENGINE_CORE, ENGINE_CORE_TO_API)

# ---- request span: GenAI attributes --------------------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" or "text_completion"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # string array
OPERATION_CHAT = "chat"
OPERATION_TEXT_COMPLETION = "text_completion"

# ---- request span: stepscope attributes and events -----------------------------------------------
REQUEST_ID = "stepscope.request_id"
NUM_CACHED_TOKENS = "stepscope.num_cached_tokens"
NUM_PREEMPTIONS = "stepscope.num_preemptions"
# What `stepscope trace replay` needs to send the request again (recorded by the front end):
# the prompt's chained hashes, one per full KV block (two prompts share their first k blocks
# exactly when their first k hashes are equal), the SamplingParams as JSON text, and, only with
# `--trace-content`, the prompt's token ids (int array).
PROMPT_BLOCK_HASHES = "stepscope.prompt_block_hashes"
SAMPLING_PARAMS = "stepscope.sampling_params"
PROMPT_TOKEN_IDS = "stepscope.prompt_token_ids"

# ---- run span: the engine configuration a run was recorded with ------------------------------
ENGINE_CONFIG = "stepscope.engine_config"  # the whole EngineConfig, as JSON text
ENTRY = "stepscope.entry"  # how requests came in: ENTRY_OFFLINE (LLM) or ENTRY_SERVE (AsyncLLM)
ENTRY_OFFLINE = "offline"
ENTRY_SERVE = "serve"

# ---- engine start: how each process was started, and what Ray took ------------------------------
BACKEND = "stepscope.backend"  # "process" or "ray"
ROLE = "stepscope.role"  # process_start: "engine_core" or "worker"
RAY_CONNECT_S = "stepscope.ray.connect_s"  # engine_start: joining or starting the cluster
RAY_PLACEMENT_S = "stepscope.ray.placement_s"  # process_start: its placement group placed
RAY_ACTOR_START_S = "stepscope.ray.actor_start_s"  # process_start: its actor up and answering
RAY_NODE_ID = "stepscope.ray.node_id"  # process_start: the node Ray put it on


class RequestEvent(StrEnum):
    """Events on the request span, each at the time it happened. The engine core reports them
    in `EngineCoreOutput.events`, keyed by these; the span and the trace file hold the values."""

    QUEUED = "queued"  # the engine core received the request (stage 3 starts)
    SCHEDULED = "scheduled"  # first admitted by the scheduler
    # A structured request's grammar compiled (or was found compiled): until then it waited for
    # it (queue reason `grammar`); absent for free text.
    GRAMMAR_READY = "grammar_ready"
    FIRST_TOKEN = "first_token"  # first token sampled
    PREEMPTED = "preempted"  # preempted (recompute); the count is NUM_PREEMPTIONS
    FINISHED = "finished"  # a stop condition hit, or aborted
    # Waited past `long_wait_warning_s` in the engine core's queue (once per request), with
    # WAITING_REASON (the head of the queue's), WAITED_S and, with kv_blocks, KV_BLOCKS_SHORT.
    LONG_WAIT = "long_wait"


# Attribute of the `long_wait` event: seconds waited since queued (or since the last preemption).
WAITED_S = "stepscope.waited_s"


# ---- engine step span ----------------------------------------------------------------------------
STEP = "stepscope.step"
NUM_RUNNING = "stepscope.num_running"
NUM_WAITING = "stepscope.num_waiting"
NUM_DECODE_TOKENS = "stepscope.num_decode_tokens"
NUM_PREFILL_TOKENS = "stepscope.num_prefill_tokens"
TOKEN_BUDGET = "stepscope.token_budget"
KV_FREE_BEFORE = "stepscope.kv_free_before"
KV_FREE_AFTER = "stepscope.kv_free_after"
KV_TOTAL_BLOCKS = "stepscope.kv_total_blocks"
PREFIX_HIT_TOKENS = "stepscope.prefix_hit_tokens"
PREEMPTED_IDS = "stepscope.preempted_ids"  # string array
FINISHED_IDS = "stepscope.finished_ids"  # string array
REQUEST_IDS = "stepscope.request_ids"  # string array: the requests this step served
REQUEST_NUM_TOKENS = "stepscope.request_num_tokens"  # int array, parallel to REQUEST_IDS
# Why the waiting queue's head was not admitted (budget, max_num_seqs, kv_blocks, preempted; or
# grammar, when every request left waiting waits for its grammar to compile),
# how many waiting requests that holds back (first come, first served: all of them), and with
# kv_blocks how many free blocks the head lacked. Absent when nobody was left waiting.
WAITING_REASON = "stepscope.waiting_reason"
WAITING_REASON_COUNT = "stepscope.waiting_reason_count"
KV_BLOCKS_SHORT = "stepscope.kv_blocks_short"
# The tokens the step's requests attend to: each scheduled request's KV length after the step
# (computed tokens, prefix hits included, plus those scheduled now), summed over the step.
NUM_CONTEXT_TOKENS = "stepscope.num_context_tokens"
# Blocks each KV cache group holds once the step is scheduled (int array, one per group: one
# entry for a model whose layers all attend alike; a hybrid model's full-attention group first).
KV_BLOCKS_BY_GROUP = "stepscope.kv_blocks_by_group"
# Each group's sliding window in tokens, parallel to KV_BLOCKS_BY_GROUP (int array; 0 where the
# group keeps every block), so a reader can name the groups.
KV_GROUP_WINDOWS = "stepscope.kv_group_windows"

# ---- worker step span ----------------------------------------------------------------------------
# The worker process's CPU time over the step (all its threads: the forward runs on several), and
# on a CPU device the threads its forward could run at once (torch's threads, capped by the cores
# the process may use). CPU time far below wall time x threads: the machine was busy elsewhere.
CPU_TIME_NS = "stepscope.cpu_time_ns"
NUM_THREADS = "stepscope.num_threads"

# ---- DP coordinator publication span: int arrays, one entry per DP rank ------------------------
DP_NUM_WAITING = "stepscope.dp_num_waiting"
DP_NUM_RUNNING = "stepscope.dp_num_running"
DP_LOST = "stepscope.dp_lost"  # 1 when the rank has been silent past the coordinator's timeout
DP_REPORT_AGE_MS = "stepscope.dp_report_age_ms"  # since the rank's last report (-1: none yet)

# ---- crossing spans (send / receive) -------------------------------------------------------------
BOUNDARY = "stepscope.boundary"
MESSAGE_TYPE = "stepscope.message_type"
MESSAGE_BODY_SIZE = "messaging.message.body.size"
NUM_REQUESTS = "stepscope.num_requests"
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_SYSTEM_ZMQ = "zmq"

# ---- OpenInference: what Phoenix (and other OpenInference backends) shows ----------------------
# Resource attribute: the Phoenix project a process's spans land in.
OPENINFERENCE_PROJECT_NAME = "openinference.project.name"
PROJECT_NAME = "stepscope"
# On every span: LLM for a request span, CHAIN for everything else (steps, phases, crossings).
OPENINFERENCE_SPAN_KIND = "openinference.span.kind"
SPAN_KIND_LLM = "LLM"
SPAN_KIND_CHAIN = "CHAIN"
# Request span: the model and the token counts, beside the GenAI keys that hold the same values.
LLM_MODEL_NAME = "llm.model_name"
LLM_TOKEN_COUNT_PROMPT = "llm.token_count.prompt"
LLM_TOKEN_COUNT_COMPLETION = "llm.token_count.completion"
LLM_TOKEN_COUNT_TOTAL = "llm.token_count.total"
# Request span, only with `--trace-content` (prompts can be private): the text in and out.
INPUT_VALUE = "input.value"
INPUT_MIME_TYPE = "input.mime_type"
OUTPUT_VALUE = "output.value"
OUTPUT_MIME_TYPE = "output.mime_type"
MIME_TYPE_TEXT = "text/plain"

# ---- carrier keys --------------------------------------------------------------------------------
# W3C `traceparent` / `tracestate`, plus the request span's own context on api->engine_core
# messages, so the engine core can link its steps to the request span itself.
CARRIER_REQUEST = "stepscope-request"
