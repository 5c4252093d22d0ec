"""Engine configuration: one typed `EngineConfig` in five parts, as vLLM's `VllmConfig` groups
them, and vLLM's device-tier defaults.

`EngineConfig.create(**flat)` is the one builder: it takes the flat names a user knows
(`max_num_seqs`, `tensor_parallel_size`, ...), fills in what depends on the device, validates
everything once and returns a frozen struct that is sent whole to every process (msgspec). What
is found at run time (the collector's address) travels beside it in `Endpoints`, never inside.
The CLI's engine flags and `LLM`'s keywords are generated from the fields below
(engine/engine_args.py): a field's docstring is its flag's help, a `Literal` its choices.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import inspect
import itertools
import json
import os
import textwrap
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import msgspec
from msgspec import field

if TYPE_CHECKING:
    import torch

# The dtypes stepscope runs, by torch's names. torch itself is imported where a device is asked
# about: the processes that only carry a config (the DP coordinator, the CLI) never load it.
DTYPES = ("float32", "float16", "bfloat16")
# The CPU flags that make bfloat16 matmul native rather than emulated.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype a checkpoint's config.json names (`torch_dtype`, or `dtype` in newer files);
    float32 where it names none, as transformers assumes."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return str(name).removeprefix("torch.")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def auto_dtype(
    checkpoint: str, device: str, flags: frozenset[str] | None = None
) -> tuple[str, str]:
    """vLLM's dtype="auto": the checkpoint's dtype where the device runs it natively, float32
    otherwise. Returns (dtype, why), the why for the start-up log and /v1/models."""
    if checkpoint not in DTYPES:
        return "float32", f"auto: the checkpoint's dtype {checkpoint!r} is not one stepscope runs"
    if checkpoint == "float32":
        # vLLM would cast a float32 checkpoint down to 16 bits on a GPU; here it stays exact.
        return "float32", "auto: the checkpoint is float32"
    if device.startswith("cuda"):
        import torch

        if checkpoint == "bfloat16" and not torch.cuda.is_bf16_supported():
            return "float16", "auto: the checkpoint is bfloat16, which this GPU does not run"
        return checkpoint, f"auto: the checkpoint is {checkpoint} and this GPU runs it"
    have = [f for f in NATIVE_BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if not have:
        return "float32", (
            f"auto: the checkpoint is {checkpoint}, but this CPU has neither "
            f"{' nor '.join(NATIVE_BF16_FLAGS)}, so 16-bit matmul would be emulated"
        )
    # A CPU runs float16 by converting it; bfloat16 is its native 16-bit type (as in vLLM).
    return "bfloat16", f"auto: the checkpoint is {checkpoint} and this CPU has {' and '.join(have)}"


def device_tier_defaults(device: str, offline: bool) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) for a device, as vLLM picks them.

    CUDA follows vLLM's GPU rows in `vllm/engine/arg_utils.py`, which is not stored at the commit
    the tutorials pin (b4622cf9, Feb 2026): they were read at 99d7eb5 (autumn 2025), in
    `EngineArgs._set_default_args` (later copies: `EngineArgs.get_batch_defaults`). A GPU of
    70 GiB or more that is not an A100 gets 8192 / 1024 for the server and 16384 / 1024 offline;
    any other GPU 2048 / 256 and 8192 / 256. (Releases after the pin add a tier for 160 GiB and
    more; stepscope follows the pin.) CPU tier: 512 tokens / 64 sequences for the server,
    1024 / 128 offline. On two cores a 2048-token step of a 135M model takes ~5 s, stalling every
    running decode that long; 512 tokens keep a step near one second while still amortising
    per-step overhead, and offline runs favour throughput over inter-token latency with twice
    that.
    """
    if device.startswith("cuda") and _cuda_available():
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        if props.total_memory / 2**30 >= 70 and "a100" not in props.name.lower():
            return (16384 if offline else 8192), 1024
        return (8192 if offline else 2048), 256
    return (1024, 128) if offline else (512, 64)


DEFAULT_MODEL = "smollm2-135m-instruct"


class _Part(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One part of `EngineConfig`. A field with a docstring (the string under it, as in vLLM's
    config classes) is an option a user sets, by keyword and as `--flag`; a field with only a
    comment is set by the engine itself. `aliases` gives an option's short flags."""

    aliases: ClassVar[dict[str, tuple[str, ...]]] = {}


class ModelConfig(_Part):
    """What runs: the checkpoint, the device and the numbers it computes in."""

    model: str = DEFAULT_MODEL
    """A built-in model name or an HF checkpoint folder."""
    device: str = "cpu"
    """cpu, or cuda[:N]."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: the checkpoint's dtype where this device runs it natively, else float32."""
    # Why `dtype` is what it is, once "auto" is resolved against the checkpoint (resolve_dtype).
    dtype_reason: str = ""
    max_model_len: int | None = None
    """Longest prompt + output, tokens (default: the model's limit)."""
    seed: int = 0
    """Seed of the sampler's generator (seeded requests use their own)."""
    attention_backend: Literal["cpu", "torch", "triton"] | None = None
    """Default: triton on CUDA; on a CPU, cpu (a C decode kernel) where a C compiler builds it,
    else torch."""
    quantization: Literal["auto", "gguf"] | None = "auto"
    """auto: a GGUF checkpoint runs its quantized blocks as they are where this device has a
    kernel for them (a CPU), else dequantized; gguf: insist on that; none: dequantize to
    dtype."""
    quantized_max_tokens: int | None = 4
    """With quantization gguf: a step of more tokens runs a dequantized copy of each weight
    through the dense GEMM (bound by FLOPs, not bytes); none: every step runs the quantized
    blocks, and no copy is kept."""
    fused_decode: bool = True
    """With GGUF weights on the cpu backend: every layer of a decode step of up to
    quantized_max_tokens tokens in one C call; off: the Python forward, op by op."""
    tokenizer: str | None = None
    """A tokenizer folder, or a .gguf file whose metadata holds one, instead of the model's."""
    # What the weights run as, once quantization is resolved: "gguf (Q4_1, Q8_0)" or a dtype.
    weight_format: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            raise RuntimeError(
                "dtype 'auto' is resolved against the checkpoint first (resolve_dtype)"
            )
        return getattr(torch, self.dtype)


class CacheConfig(_Part):
    """The paged KV cache: block size, pool size, prefix caching."""

    block_size: int = 16
    """Tokens per KV block (a multiple of 16)."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool (default: from the memory fraction)."""
    kv_cache_memory_fraction: float | None = None
    """Share of free memory the KV pool takes, in (0, 1)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prompt prefix already computed."""
    disable_hybrid_kv_cache_manager: bool = False
    """One block table for every layer of a model that mixes sliding-window and full attention,
    keeping every block (the window still applies in attention), instead of a table per group of
    layers whose sliding-window tables give back the blocks the window has left behind."""


class SchedulerConfig(_Part):
    """The token budget of a step and how a prompt may be split across steps."""

    max_num_batched_tokens: int | None = None
    """Tokens per step (default: the device tier's)."""
    max_num_seqs: int | None = None
    """Sequences per step (default: the device tier's)."""
    enable_chunked_prefill: bool = True
    """Split a long prompt across steps, beside running decodes."""
    async_scheduling: bool = False
    """Schedule the next step, and process the last one's outputs, while the current step's
    forward runs (vLLM's AsyncScheduler): the CPU work leaves the critical path; the tokens do not
    change."""


class ParallelConfig(_Part):
    """Which processes run the engine: executor, tensor and data parallelism, machines."""

    aliases: ClassVar[dict[str, tuple[str, ...]]] = {
        "tensor_parallel_size": ("--tp",),
        "data_parallel_size": ("--dp",),
        "executor": ("--distributed-executor-backend",),
    }

    executor: Literal["uni", "mp", "ray"] = "uni"
    """uni: the worker runs inside the engine core's process; mp: one process per TP rank; ray:
    one Ray actor per TP rank (engine/executor/ray_distributed_executor.py)."""
    tensor_parallel_size: int = 1
    """Workers one engine's model is split over."""
    data_parallel_size: int = 1
    """Engine cores, each with its own scheduler, KV pool and TP workers."""
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    """How the engine cores of the DP ranks start: mp, a process each on this machine (or
    --headless on others); ray, a Ray actor each in its own placement group, on the cluster at
    $RAY_ADDRESS or a local one started for the run (engine/executor/ray_utils.py)."""
    data_parallel_size_local: int | None = None
    """DP ranks whose engine cores run on this machine (default: all of them)."""
    # Set per engine-core process when it starts (as vLLM's DP engine cores set theirs): the DP
    # rank it serves, and its index among the ranks of its machine (which GPUs it takes).
    data_parallel_rank: int = 0
    data_parallel_rank_local: int = 0
    nnodes: int = 1
    """Machines one engine's TP workers are spread over (--tp is the total)."""
    node_rank: int = 0
    """This machine's index among --nnodes (0: the engine core's; others: --headless)."""
    master_addr: str = "127.0.0.1"
    """Node 0's address: the workers' sockets and torch.distributed's rendezvous."""
    master_port: int = 29500
    """torch.distributed's port on node 0 (the workers' sockets take the next two)."""
    # Set for a process that Ray placed (its bundle's CPUs), which this machine's cores and DP
    # ranks cannot tell: the torch threads it runs with. 0: the cores shared evenly.
    cpu_threads: int = 0

    @property
    def tensor_parallel_size_local(self) -> int:
        """TP workers on this machine."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def data_parallel_ranks_here(self) -> int:
        """DP ranks on this machine."""
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def cpu_threads_per_process(self) -> int:
        """Torch threads for one compute process on CPU: the cores shared evenly by every
        process that runs a forward pass (DP ranks x TP workers), unless Ray placed it."""
        if self.cpu_threads:
            return self.cpu_threads
        processes = self.data_parallel_ranks_here * self.tensor_parallel_size_local
        return max(1, len(os.sched_getaffinity(0)) // processes)


class ObservabilityConfig(_Part):
    """What is traced and where spans go (besides the collector, whose address is found at run
    time: `Endpoints`)."""

    trace_db: str | None = None
    """DuckDB file for the spans (LLM: none, nothing recorded; serve: runs/serve-<time>.duckdb
    unless --no-trace)."""
    otlp_endpoint: str | None = None
    """Also send every span to this OTLP/HTTP endpoint (Jaeger, Phoenix, ...)."""
    trace_steps: str = "all"
    """Which steps record spans: all, every:N or off (requests always do)."""
    trace_content: bool = False
    """Put each request's prompt and generated text on its span (input.value, output.value);
    off by default, as prompts can be private."""
    long_wait_warning_s: float | None = 30.0
    """Once a request has waited this many seconds in the engine core's queue, say so once: a
    warning line naming the reason the scheduler recorded for the head of the queue, and a
    long_wait event on its request span; none: never. An offline engine (LLM) keeps the span
    events and logs no line: its `generate` queues whole batches by design."""


# vLLM's names for options stepscope names otherwise, accepted by `create` (and so by `LLM`).
FLAT_ALIASES = {"distributed_executor_backend": "executor"}

PARTS: dict[str, type[msgspec.Struct]] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "observability_config": ObservabilityConfig,
}


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole engine configuration, sent whole across every process boundary. Build it with
    `create`, which validates; decoding it in another process only checks types."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    # An offline engine (LLM) or a server (AsyncLLM, serve): the device tier's defaults differ.
    offline: bool = True

    @classmethod
    def create(cls, **flat: Any) -> EngineConfig:
        """Build and validate a config from flat field names (`max_num_seqs=8`), plus
        `offline`. An unknown name is refused with the nearest valid one; a bad value with a
        message naming the field."""
        offline = flat.pop("offline", True)
        for alias, name in FLAT_ALIASES.items():
            if alias in flat:
                if name in flat:
                    raise ValueError(f"give {name} or {alias}, not both: they are one option")
                flat[name] = flat.pop(alias)
        values: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
        settable = field_parts(internal=True)
        for name, value in flat.items():
            if isinstance(value, os.PathLike):
                value = os.fspath(value)  # trace_db=Path(...)
            if name not in settable:
                raise ValueError(unknown_name_message(name, settable))
            values[settable[name]][name] = value
        parts = {}
        for part, part_cls in PARTS.items():
            try:
                parts[part] = msgspec.convert(values[part], part_cls, strict=False)
            except msgspec.ValidationError as e:
                raise ValueError(_field_error(part_cls, values[part], e)) from e
        return _validated(cls(**parts, offline=offline))

    def resolve_dtype(self, model_dir: str | Path) -> EngineConfig:
        """This config with dtype="auto" turned into this machine's choice for the checkpoint,
        and why (an explicit dtype is kept, "asked for"). Quantization is settled beside it,
        by the loader, which reads the checkpoint's files (loader.resolve_config)."""
        m = self.model_config
        if m.dtype == "auto":
            dtype, why = auto_dtype(checkpoint_dtype(model_dir), m.device)
        else:
            dtype, why = m.dtype, m.dtype_reason or "asked for"
        return self.replace(model_config=msgspec.structs.replace(m, dtype=dtype, dtype_reason=why))

    def replace(self, **parts: Any) -> EngineConfig:
        return msgspec.structs.replace(self, **parts)

    def for_dp_rank(self, rank: int, local_index: int, local_size: int | None) -> EngineConfig:
        """The copy one engine-core process of DP rank `rank` runs with (`local_index`-th of
        `local_size` ranks on its machine)."""
        p = msgspec.structs.replace(
            self.parallel_config,
            data_parallel_rank=rank,
            data_parallel_rank_local=local_index,
            data_parallel_size_local=local_size,
        )
        return self.replace(parallel_config=p)

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name, as `create` takes them."""
        out: dict[str, Any] = {"offline": self.offline}
        for part in PARTS:
            out.update(msgspec.structs.asdict(getattr(self, part)))
        return out


class Endpoints(msgspec.Struct, frozen=True):
    """What a run's processes find out at run time, sent beside `EngineConfig` to each: where
    spans go (None: this run records none through a collector), the Ray cluster, and the
    context their start is traced under."""

    collector: str | None = None
    ray_address: str | None = None  # the Ray cluster a run's ray backends use, for its processes
    # The W3C context of the engine's start span (`stepscope.engine_start`): each process records
    # the start of the processes it starts under it (an engine core, its workers).
    startup_context: dict[str, str] | None = None


def _field_error(part: type, values: dict[str, Any], error: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.max_num_seqs`" as "max_num_seqs: ...",
    and a value outside a `Literal` as the values it may take."""
    problem, _, where = str(error).partition(" - at `$.")
    name = where.rstrip("`")
    _, choices = option_type(typing.get_type_hints(part).get(name))
    if choices:
        allowed = ", ".join(repr(c) for c in choices)
        return f"{name} must be one of {allowed}, got {values.get(name)!r}"
    return f"{name or part.__name__}: {problem}"


def option_type(annotation: Any) -> tuple[Any, tuple | None]:
    """(int, None) for `int | None`; (str, its values) for a `Literal` of strings."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(t for t in get_args(annotation) if t is not type(None))
    if typing.get_origin(annotation) is Literal:
        return str, get_args(annotation)
    return annotation, None


def field_parts(internal: bool = False) -> dict[str, str]:
    """Each field's flat name -> the part that holds it; without `internal`, only the options a
    user sets (the fields with a docstring)."""
    out = {}
    for part, part_cls in PARTS.items():
        docs = option_docs(part_cls)
        for name in part_cls.__struct_fields__:
            if internal or name in docs:
                out[name] = part
    return out


@functools.cache
def option_docs(part: type) -> dict[str, str]:
    """A part's options: each field that has a docstring, and that docstring on one line."""
    docs: dict[str, str] = {}
    for cls in reversed(part.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, _Part)):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for field_node, doc in itertools.pairwise(body):
            if (
                isinstance(field_node, ast.AnnAssign)
                and isinstance(field_node.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                docs[field_node.target.id] = " ".join(doc.value.value.split())
    return docs


def unknown_name_message(name: str, known: dict[str, str] | list[str]) -> str:
    near = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"unknown engine option {name!r}{hint}"


def _validated(c: EngineConfig) -> EngineConfig:
    """Fill in the device-dependent defaults and check every relation between fields, with a
    message a user can act on. Runs once, in `create`."""
    m, cache, s, p, o = (c.model_config, c.cache_config, c.scheduler_config, c.parallel_config,
                         c.observability_config)  # fmt: skip
    if not (m.device == "cpu" or m.device.startswith("cuda")):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {m.device!r}")
    if m.device.startswith("cuda") and not _cuda_available():
        raise ValueError(f"device {m.device!r} asked for, but CUDA is not available")
    if m.attention_backend == "cpu" and m.device.startswith("cuda"):
        raise ValueError("attention_backend 'cpu' runs on the CPU only: use 'triton'")
    # None stays None: the worker picks the device's default (engine/layers/attention.py), so
    # that building a config never builds or loads the C kernels.
    if cache.block_size <= 0 or cache.block_size % 16:
        raise ValueError(f"block_size must be a multiple of 16, got {cache.block_size}")
    if cache.num_kv_blocks is not None and cache.num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be at least 1, got {cache.num_kv_blocks}")
    fraction = cache.kv_cache_memory_fraction
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1), got {fraction}")
    s = _scheduler_defaults(s, m, c.offline)
    _check_parallel(p)
    if m.device.startswith("cuda") and "ray" in (p.executor, p.data_parallel_backend):
        raise ValueError(
            "the ray backends place CPU processes only in this version (their actors ask Ray "
            "for no GPU): on CUDA use the mp backends (docs/scaling.md, section 10)"
        )
    from stepscope.traces.setup import TraceSampling

    TraceSampling(o.trace_steps)  # raises ValueError on a malformed --trace-steps
    wait = o.long_wait_warning_s
    if wait is not None and not wait > 0:
        raise ValueError(f"long_wait_warning_s must be positive (none: never warn), got {wait}")
    return c.replace(scheduler_config=s)


def _scheduler_defaults(s: SchedulerConfig, m: ModelConfig, offline: bool) -> SchedulerConfig:
    budget, seqs = device_tier_defaults(m.device, offline)
    s = msgspec.structs.replace(
        s,
        max_num_batched_tokens=budget
        if s.max_num_batched_tokens is None
        else s.max_num_batched_tokens,
        max_num_seqs=seqs if s.max_num_seqs is None else s.max_num_seqs,
    )
    if s.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be positive, got {s.max_num_batched_tokens}")
    if s.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {s.max_num_seqs}")
    check_no_chunk_budget(s, m.max_model_len)
    return s


def check_no_chunk_budget(s: SchedulerConfig, max_model_len: int | None) -> None:
    """Without chunked prefill every prompt must fit in one step's budget. Checked where the
    config is built against an explicit max_model_len, and again by the engine core against the
    length it derives from the model."""
    if (
        not s.enable_chunked_prefill
        and max_model_len is not None
        and s.max_num_batched_tokens < max_model_len
    ):
        raise ValueError(
            "without chunked prefill every prompt must fit in one step: max_num_batched_tokens "
            f"({s.max_num_batched_tokens}) must be >= max_model_len ({max_model_len}); raise "
            "the budget or lower max_model_len"
        )


RAY_INSTALL = "pip install -e '.[ray]' (in a checkout) or pip install 'ray==2.58.0'"


def require_ray() -> None:
    """Refuse a ray backend, with how to install Ray, where Ray is missing (an optional extra;
    engine/executor/ray_utils.py uses it)."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError(f"the ray backend needs Ray, which is not installed here: {RAY_INSTALL}")


def _check_parallel(p: ParallelConfig) -> None:
    if p.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {p.tensor_parallel_size}")
    if p.tensor_parallel_size > 1 and p.executor == "uni":
        raise ValueError(
            "tensor_parallel_size > 1 needs executor='mp' or 'ray' (one process per rank)"
        )
    if "ray" in (p.executor, p.data_parallel_backend):
        require_ray()
    if p.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {p.data_parallel_size}")
    if not 0 <= p.data_parallel_rank < p.data_parallel_size:
        raise ValueError(
            f"data_parallel_rank must be in [0, {p.data_parallel_size}), got {p.data_parallel_rank}"
        )
    local = p.data_parallel_size_local
    if local is not None and not 0 <= local <= p.data_parallel_size:
        raise ValueError(
            f"data_parallel_size_local must be in [0, {p.data_parallel_size}], got {local}"
        )
    if p.nnodes < 1 or not 0 <= p.node_rank < p.nnodes:
        raise ValueError(
            f"nnodes must be >= 1 and node_rank in [0, nnodes), got {p.nnodes} and {p.node_rank}"
        )
    if p.nnodes > 1:
        if p.tensor_parallel_size % p.nnodes:
            raise ValueError(
                f"tensor_parallel_size {p.tensor_parallel_size} must be a multiple of "
                f"nnodes {p.nnodes}: every machine holds the same number of workers"
            )
        if p.executor != "mp" or p.data_parallel_size != 1 or p.data_parallel_backend != "mp":
            raise ValueError(
                "tensor parallelism across machines (nnodes > 1) needs executor='mp' and "
                "one DP rank; to add DP ranks on other machines use --headless with "
                "--data-parallel-size-local"
            )


def init_engine_process_tracing(
    service: str, config: EngineConfig, endpoints: Endpoints, **where: Any
) -> None:
    """Start tracing in one of the engine's processes: spans to the run's collector and OTLP
    endpoint, steps sampled as configured; `where` says which rank this process is."""
    from stepscope.traces.setup import init_process_tracing

    o = config.observability_config
    init_process_tracing(
        service,
        collector_endpoint=endpoints.collector,
        otlp_endpoint=o.otlp_endpoint,
        trace_steps=o.trace_steps,
        **where,
    )
