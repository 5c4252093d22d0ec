"""Engine configuration: validated dataclasses and vLLM's device-tier defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
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
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        if props.total_memory / 2**30 >= 70 and "a100" not in props.name.lower():
            return (16384 if offline else 8192), 1024
        return (8192 if offline else 2048), 256
    return (1024, 128) if offline else (512, 64)


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    device: str = "cpu"
    # "auto": the checkpoint's dtype where this device runs it natively (see `auto_dtype`),
    # resolved by `resolve_dtype` once the checkpoint is known.
    dtype: str = "auto"
    dtype_reason: str = ""
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str | None = None  # None: the worker picks the device's default
    seed: int = 0
    offline: bool = True
    # "uni": the worker runs inside the engine core's process; "mp": one process per TP rank.
    executor: str = "uni"
    tensor_parallel_size: int = 1
    # Data parallelism: this many engine cores, each with its own scheduler, KV pool and TP
    # workers; `data_parallel_rank` is the one a core process is (0 in the API process).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Its index among the ranks on its own machine (which GPUs it takes), and how many ranks
    # that machine runs (they share its cores and memory; default: every rank).
    data_parallel_rank_local: int = 0
    data_parallel_size_local: int | None = None
    # Tensor parallelism across machines: `nnodes` machines hold `tensor_parallel_size / nnodes`
    # workers each; node 0 runs the engine core, the others only workers (`serve --headless`).
    # The workers' sockets and torch.distributed's rendezvous are at master_addr:master_port+.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # Tracing: where every process sends its spans (the collector's URL), and which steps record.
    collector_endpoint: str | None = None
    otlp_endpoint: str | None = None
    trace_steps: str = "all"
    # The prompt and the generated text on each request span (off: prompts can be private).
    trace_content: bool = False

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available")
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}"
            )
        budget, seqs = device_tier_defaults(self.device, self.offline)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = budget
        if self.max_num_seqs is None:
            self.max_num_seqs = seqs
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) so that any prompt fits in one step"
            )
        if self.executor not in ("uni", "mp"):
            raise ValueError(f"executor must be 'uni' or 'mp', got {self.executor!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size > 1 and self.executor != "mp":
            raise ValueError("tensor_parallel_size > 1 needs executor='mp' (one process per rank)")
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}"
            )
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                f"got {self.data_parallel_rank}"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"nnodes must be >= 1 and node_rank in [0, nnodes), got {self.nnodes} and "
                f"{self.node_rank}"
            )
        if self.nnodes > 1:
            if self.tensor_parallel_size % self.nnodes:
                raise ValueError(
                    f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of "
                    f"nnodes {self.nnodes}: every machine holds the same number of workers"
                )
            if self.executor != "mp" or self.data_parallel_size != 1:
                raise ValueError(
                    "tensor parallelism across machines (nnodes > 1) needs executor='mp' and "
                    "one DP rank; to add DP ranks on other machines use --headless with "
                    "--data-parallel-size-local"
                )
            if self.master_port is None:
                raise ValueError("nnodes > 1 needs master_port (--master-port)")
        from stepscope.traces.setup import TraceSampling

        TraceSampling(self.trace_steps)  # raises ValueError on a malformed --trace-steps
        if self.attention_backend not in (None, "cpu", "torch", "triton"):
            raise ValueError(
                "attention_backend must be 'cpu', 'torch' or 'triton', got "
                f"{self.attention_backend!r}"
            )
        on_cpu = not self.device.startswith("cuda")
        if self.attention_backend == "cpu" and not on_cpu:
            raise ValueError("attention_backend 'cpu' runs on the CPU only: use 'triton'")
        # None stays None: the worker picks the device's default (engine/layers/attention.py),
        # so that building a config never builds or loads the C kernels.

    @property
    def tensor_parallel_size_local(self) -> int:
        """TP workers on this machine."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_data_parallel_size(self) -> int:
        """DP ranks on this machine."""
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def cpu_threads_per_process(self) -> int:
        """Torch threads for one compute process on CPU: the cores shared evenly by every
        process that runs a forward pass (DP ranks x TP workers)."""
        import os

        processes = self.local_data_parallel_size * self.tensor_parallel_size_local
        return max(1, len(os.sched_getaffinity(0)) // processes)

    def resolve_dtype(self, model_dir: str | Path) -> None:
        """Turn dtype="auto" into this machine's choice for the checkpoint, and say why."""
        if self.dtype == "auto":
            self.dtype, self.dtype_reason = auto_dtype(checkpoint_dtype(model_dir), self.device)
        elif not self.dtype_reason:
            self.dtype_reason = "asked for"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise RuntimeError(
                "dtype 'auto' is resolved against the checkpoint first (resolve_dtype)"
            )
        return DTYPES[self.dtype]
