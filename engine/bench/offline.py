"""`stepscope bench offline`: stepscope against transformers `generate` on one seeded workload,
same model, dtype and machine, in one run. Prints tokens/s of each, their ratio, and stepscope's
model-FLOP utilisation against a large matmul of the same dtype timed in the same run.

`--dtype float32,bfloat16` repeats the whole comparison per dtype. A dtype whose matmul runs far
below float32's on this CPU (bfloat16 without AVX512_BF16 or AMX is emulated, 10-300x slower) is
skipped with its measured rate unless `--force-dtype` is given: such a run takes hours and
measures the emulation, not the engine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> Workload:
    """Random token prompts and output lengths, uniform in the given ranges, from one seed."""
    for name, (low, high) in (("prompt", prompt_range), ("output", output_range)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} lengths need 1 <= min <= max, got {low}-{high}")
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))]
        for _ in range(num_requests)
    ]
    outputs = [rng.randint(*output_range) for _ in range(num_requests)]
    return Workload(prompts, outputs)


def alternating(settings: list[str], repeat: int) -> list[tuple[int, str]]:
    """(run, setting) pairs: `repeat` runs of each setting, the order reversed every other run
    (off, on, on, off, ...), so that a machine that speeds up or slows down during a benchmark
    favours no setting."""
    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeat}")
    return [
        (run, setting)
        for run in range(repeat)
        for setting in (settings if run % 2 == 0 else settings[::-1])
    ]


def matmul_peak_gflops(dtype: torch.dtype = torch.float32, n: int = 2048, reps: int = 5) -> float:
    """Sustained GFLOP/s of one large square matmul: the roofline the engine is measured against."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def model_flops(cfg: dict, workload: Workload) -> float:
    """Useful FLOPs of the workload: every prompt and generated token through the layers, causal
    attention over its context, and the LM head only where a token is sampled."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    per_token = 2 * layers * (h * (heads + 2 * kv) * d + heads * d * h + 3 * h * i)
    attn_per_ctx = 4 * layers * heads * d  # QK^T and PV, per (query, key) pair
    total = 0.0
    for prompt, out in zip(workload.prompts, workload.output_lens, strict=True):
        n = len(prompt) + out - 1  # tokens that go through the model
        total += n * per_token + attn_per_ctx * n * (n + 1) / 2 + 2 * h * vocab * out
    return total


def run_stepscope(
    model: str,
    workload: Workload,
    args: argparse.Namespace,
    executor: str = "uni",
    trace_db: str | None = None,
    dtype: str = "float32",
    data_parallel_size: int = 1,
    quantization: str | None = "auto",
    async_scheduling: bool = False,
    data_parallel_backend: str = "mp",
    startup: list[float] | None = None,
) -> tuple[float, list[float]]:
    """Seconds to generate the workload, and each request's TTFT (first token - arrival);
    the seconds `LLM(...)` took to start are appended to `startup`, if given."""
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.frontend.core_client import InprocClient
    from stepscope.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=model,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        executor=executor,
        trace_db=trace_db,
        dtype=dtype,
        data_parallel_size=data_parallel_size,
        data_parallel_backend=data_parallel_backend,
        quantization=quantization,
        async_scheduling=async_scheduling,
    )
    if startup is not None:
        startup.append(time.perf_counter() - started)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    # Warm-up: first touches of the allocator and the KV pool are not what we measure.
    llm.generate(workload.prompts[:4], params[:4], use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == workload.num_output_tokens, (got, workload.num_output_tokens)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    cfg = llm.config.scheduler_config
    stats = llm.get_stats()
    ranks = f"{data_parallel_size} DP ranks x " if data_parallel_size > 1 else ""
    print(
        f"  stepscope ({executor}): {ranks}budget {cfg.max_num_batched_tokens} tokens/step, "
        f"max_num_seqs {cfg.max_num_seqs}, {stats['num_kv_blocks']} KV blocks, "
        f"{stats['num_steps']} steps, {stats['num_preemptions']} preemptions"
    )
    if not isinstance(llm.client, InprocClient):
        p50, p99 = api_overhead_us(llm, workload)
        print(f"  API side per request (route to a rank, encode, send): p50 {p50:.0f} us, "
              f"p99 {p99:.0f} us")  # fmt: skip
    if data_parallel_size > 1:
        served = [r["num_steps"] for r in stats["ranks"]]
        print(
            f"  steps per DP rank: {served}; torch threads per rank "
            f"{llm.config.parallel_config.cpu_threads_per_process}"
        )
    if "crossing_median_s" in stats:
        print(
            "  median core -> worker -> core crossing per step: "
            f"{stats['crossing_median_s'] * 1e6:.0f} us"
        )
    llm.shutdown()
    return elapsed, ttfts


def api_overhead_us(llm, workload: Workload, n: int = 200) -> tuple[float, float]:
    """What the client adds per request on the API side: choosing the least-loaded DP rank,
    encoding the EngineCoreRequest and handing it to ZMQ (p50, p99 in microseconds). Measured on
    the workload's prompts with max_tokens=1, the requests aborted afterwards."""
    from stepscope.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    requests = [
        llm.processor.process(f"overhead-{i}", workload.prompts[i % len(workload.prompts)], params)
        for i in range(n)
    ]
    times = []
    for req in requests:
        start = time.perf_counter_ns()
        llm.client.add_request(req)
        times.append((time.perf_counter_ns() - start) / 1e3)
    llm.client.abort_requests([r.request_id for r in requests])
    times.sort()
    return times[n // 2], times[int(0.99 * (n - 1))]


def run_transformers(
    model_dir, workload: Workload, batch_size: int, dtype: str = "float32"
) -> float:
    """Length-sorted static batches, left-padded; each batch runs to its longest output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    start = time.perf_counter()
    generate_batches(model, workload, batch_size)
    return time.perf_counter() - start


def generate_batches(model, workload: Workload, batch_size: int, device: str = "cpu") -> None:
    """transformers `generate` over the workload as the baseline runs it: length-sorted static
    batches, left-padded, each to its longest output (also the GPU check's baseline)."""
    pad = model.generation_config.pad_token_id or 0
    order = sorted(range(len(workload.prompts)), key=lambda r: len(workload.prompts[r]))
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        width = max(len(workload.prompts[r]) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            p = workload.prompts[r]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(workload.output_lens[r] for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )


# Below this fraction of float32's matmul rate a dtype is emulated on this CPU, not native.
NATIVE_FRACTION = 0.25


def cpu_matmul_features() -> str:
    """The CPU flags that decide whether bfloat16 matmul is native (Linux only; else empty)."""
    from stepscope.engine.config import cpu_flags

    flags = cpu_flags()
    if not flags:
        return ""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f"{f}{'+' if f in flags else '-'}" for f in wanted)


def bench_offline(args: argparse.Namespace) -> None:
    from stepscope.engine.config import DTYPES
    from stepscope.engine.models.loader import load_config, resolve_model

    dtypes = args.dtype.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"--dtype: unknown {unknown}; choose from {sorted(DTYPES)}")
    _dp_sizes(args.dp)  # a bad --dp or --async-scheduling fails before anything runs
    _async_settings(args.async_scheduling)
    _backends(args.data_parallel_backend)
    model_dir = resolve_model(args.model)
    cfg = load_config(model_dir)
    workload = make_workload(
        args.num_requests,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        cfg["vocab_size"],
        args.seed,
    )
    n_prompt = sum(len(p) for p in workload.prompts)
    features = cpu_matmul_features()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus"
        f"{f' ({features})' if features else ''}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; model {args.model}, {args.dtype}"
    )
    print(
        f"workload: {args.num_requests} requests (seed {args.seed}), prompts "
        f"{args.min_prompt}-{args.max_prompt} tokens ({n_prompt} in all), outputs "
        f"{args.min_output}-{args.max_output} ({workload.num_output_tokens} in all), greedy, "
        "ignore_eos"
    )
    flops = model_flops(cfg, workload)
    # A quick probe first: an emulated dtype's 2048^3 matmul alone would take minutes.
    probe = {d: matmul_peak_gflops(getattr(torch, d), n=512, reps=3) for d in {"float32", *dtypes}}
    summary = []
    quantizations = [None if q == "none" else q for q in args.quantization.split(",")]
    asyncs = _async_settings(args.async_scheduling)
    for quantization, dtype, async_ in itertools.product(quantizations, dtypes, asyncs):
        setting = dtype if len(quantizations) == 1 else f"{quantization or 'none'}/{dtype}"
        if len(asyncs) > 1:
            setting += f"/async {'on' if async_ else 'off'}"
        print(f"--- {setting}")
        share = probe[dtype] / probe["float32"]
        if share < NATIVE_FRACTION and not args.force_dtype:
            print(
                f"{dtype}: skipped: its matmul runs at {probe[dtype]:.1f} GFLOP/s, "
                f"{share:.2f}x float32's {probe['float32']:.1f} (512^3) on this CPU: it is "
                "emulated here, not native (bfloat16 needs avx512_bf16 or amx_bf16); "
                "--force-dtype runs it anyway"
            )
            summary.append(f"{dtype}: skipped ({share:.2f}x float32's matmul rate)")
            continue
        peak = matmul_peak_gflops(getattr(torch, dtype))
        print(f"matmul roofline: {peak:.1f} GFLOP/s (2048^3 {dtype})")
        tps_ss = _bench_stepscope(args, workload, flops, peak, dtype, quantization, async_)
        mfu = flops * tps_ss / workload.num_output_tokens / 1e9 / peak
        line = f"{setting}: stepscope {tps_ss:.1f} output tok/s, MFU {mfu:.0%}"
        if not args.skip_transformers:
            t_hf = run_transformers(model_dir, workload, args.hf_batch_size, dtype)
            tps_hf = workload.num_output_tokens / t_hf
            print(
                f"transformers ({dtype}): {t_hf:8.1f} s  {tps_hf:7.1f} output tok/s  "
                f"(static batches of {args.hf_batch_size}, length-sorted)"
            )
            print(f"ratio stepscope / transformers ({dtype}): {tps_ss / tps_hf:.2f}x")
            line += f"; transformers {tps_hf:.1f} tok/s; ratio {tps_ss / tps_hf:.2f}x"
        summary.append(line)
    if len(summary) > 1:
        print("--- summary")
        for line in summary:
            print(line)


def _bench_stepscope(
    args: argparse.Namespace,
    workload: Workload,
    flops: float,
    peak: float,
    dtype: str,
    quantization: str | None = "auto",
    async_scheduling: bool = False,
) -> float:
    """Every executor x DP size x tracing setting in one dtype; returns the best setting's output
    tok/s."""
    repeat = args.repeat
    backends = _backends(args.data_parallel_backend)
    # Tracing settings and DP backends take turns run by run (each pair a setting).
    settings = [f"{t}|{b}" for t in args.tracing.split(",") for b in backends]
    runs = [(rep, *setting.split("|")) for rep, setting in alternating(settings, repeat)]
    dps = _dp_sizes(args.dp)
    seconds: dict[str, list[float]] = {}
    ttfts: dict[str, list[float]] = {}
    startups: dict[str, list[float]] = {}
    for executor in args.executor.split(","):
        for dp in dps:
            for rep, tracing, backend in runs:
                trace_db = None
                if tracing == "on":
                    folder = Path(tempfile.mkdtemp(prefix="stepscope-bench-"))
                    trace_db = str(folder / "trace.duckdb")
                label = _label(executor, dp, len(dps) > 1, args.tracing, tracing)
                if len(backends) > 1:
                    label += f", {backend} backend"
                elapsed, ttft = run_stepscope(
                    args.model,
                    workload,
                    args,
                    executor,
                    trace_db,
                    dtype,
                    dp,
                    quantization,
                    async_scheduling,
                    backend,
                    startups.setdefault(label, []),
                )
                seconds.setdefault(label, []).append(elapsed)
                ttfts.setdefault(label, []).extend(ttft)
                mfu = flops / elapsed / 1e9 / peak
                run = f" run {rep + 1}" if repeat > 1 else ""
                print(
                    f"stepscope ({label}, {dtype}){run}: {elapsed:8.1f} s  "
                    f"{workload.num_output_tokens / elapsed:7.1f} output tok/s  MFU {mfu:.0%}  "
                    f"TTFT p50 {statistics.median(ttft):.2f} s  start-up "
                    f"{startups[label][-1]:.1f} s",
                    flush=True,
                )
    # Throughput of a setting over all its runs: every token it generated over all its time.
    results = {
        label: workload.num_output_tokens * len(times) / sum(times)
        for label, times in seconds.items()
    }
    if repeat > 1:
        for label, rate in results.items():
            spread = [workload.num_output_tokens / t for t in seconds[label]]
            print(
                f"stepscope ({label}) over {repeat} runs: {rate:7.1f} output tok/s "
                f"(runs {min(spread):.1f}-{max(spread):.1f})"
            )
    for tracing in args.tracing.split(","):
        for dp in dps:
            uni = results.get(_label("uni", dp, len(dps) > 1, args.tracing, tracing))
            mp = results.get(_label("mp", dp, len(dps) > 1, args.tracing, tracing))
            if uni and mp:
                print(f"ratio mp / uni ({_label('', dp, len(dps) > 1, args.tracing, tracing)}): "
                      f"{mp / uni:.3f}x")  # fmt: skip
    for executor in args.executor.split(","):
        for dp in dps:
            on = results.get(_label(executor, dp, len(dps) > 1, "on", "on"))
            off = results.get(_label(executor, dp, len(dps) > 1, "on", "off"))
            if on and off:
                print(f"ratio tracing on / off ({_label(executor, dp, len(dps) > 1)}): "
                      f"{on / off:.3f}x")  # fmt: skip
    if len(backends) > 1:
        _print_backend_comparison(results, startups, backends)
    if len(dps) > 1:
        _print_dp_comparison(args, dps, results, ttfts)
    return max(results.values())


def _backends(spec: str) -> list[str]:
    """--data-parallel-backend: mp, ray, or both in the order given."""
    values = [v.strip() for v in spec.split(",")]
    if not values or any(v not in ("mp", "ray") for v in values) or len(set(values)) < len(values):
        raise SystemExit(f"--data-parallel-backend: mp, ray, or 'mp,ray', got {spec!r}")
    return values


def _print_backend_comparison(
    results: dict[str, float], startups: dict[str, list[float]], backends: list[str]
) -> None:
    """Each setting's throughput and start-up on every backend, against the first given."""
    print(f"--- DP backends ({', '.join(backends)}), runs alternating")
    for label, rate in results.items():
        first = f", {backends[0]} backend"
        if not label.endswith(first):
            continue
        base = label.removesuffix(first)
        for backend in backends:
            other = f"{base}, {backend} backend"
            times = startups[other]
            print(
                f"{other}: {results[other]:7.1f} output tok/s ({results[other] / rate:.3f}x "
                f"{backends[0]}), start-up median {statistics.median(times):.1f} s "
                f"(runs {', '.join(f'{t:.1f}' for t in times)})"
            )


def _async_settings(spec: str) -> list[bool]:
    """--async-scheduling: off, on, or both in the order given."""
    values = [v.strip() for v in spec.split(",")]
    if not values or any(v not in ("off", "on") for v in values):
        raise SystemExit(f"--async-scheduling: off, on, or 'off,on', got {spec!r}")
    return [v == "on" for v in values]


def _dp_sizes(spec: str) -> list[int]:
    try:
        sizes = [int(x) for x in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--dp: a comma-separated list of sizes, e.g. 1,2; got {spec!r}") from None
    if any(n < 1 for n in sizes):
        raise SystemExit(f"--dp: sizes must be at least 1, got {spec!r}")
    return sizes


def _label(
    executor: str, dp: int, several_dp: bool, tracing_spec: str = "off", tracing: str = "off"
) -> str:
    parts = [executor] if executor else []
    if several_dp:
        parts.append(f"dp {dp}")
    if tracing_spec != "off":
        parts.append(f"tracing {tracing}")
    return ", ".join(parts)


def _print_dp_comparison(
    args: argparse.Namespace,
    dps: list[int],
    results: dict[str, float],
    ttfts: dict[str, list[float]],
) -> None:
    """Throughput and TTFT per DP size, side by side, against the first size given."""
    print("--- data parallelism (each rank: cores / (DP x TP) torch threads)")
    for executor in args.executor.split(","):
        for tracing in args.tracing.split(","):
            base = _label(executor, dps[0], True, args.tracing, tracing)
            for dp in dps:
                label = _label(executor, dp, True, args.tracing, tracing)
                t = sorted(ttfts[label])
                print(
                    f"{label}: {results[label]:7.1f} output tok/s "
                    f"({results[label] / results[base]:.2f}x dp {dps[0]}), TTFT p50 "
                    f"{statistics.median(t):.2f} s, p90 {t[int(0.9 * (len(t) - 1))]:.2f} s"
                )
