"""`stepscope bench latency`: one request at a time, as one person chatting feels the engine.

llama-bench's tg128 shape by default: a prompt of 32 random tokens, then 128 output tokens,
greedy, ignore_eos. Each setting (quantization x dtype x async scheduling) gets its own `LLM`,
all loaded once, then run in turn, the order alternating run by run so that a machine speeding
up or slowing down favours none. Per setting: the time to first token (a 1-token request),
the time per output token after it (`(T(128) - T(1)) / 127`), its tokens/s, and, for the
weights, the bytes a decode step reads and the time reading them takes at the memory bandwidth
measured in the same run: the floor a one-stream decode cannot go under.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import time

import torch


def memory_bandwidth_gbs(megabytes: int = 512, reps: int = 5) -> float:
    """GB/s of reading a buffer far larger than the caches (a sum over it), best of `reps`."""
    buf = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def weight_bytes_per_token(llm) -> int:
    """What one decode step reads of the model's weights: each projection and the LM head as
    the step's matmul reads it (the quantized blocks where they run, else the dense tensor),
    plus one embedding row; norms are noise."""
    from stepscope.engine.layers.quantization import QuantizedWeight

    model = llm.frontend.client.core.executor.worker.model_runner.model  # uni executor

    def size(w) -> int:
        if isinstance(w, QuantizedWeight):
            return w.nbytes
        if isinstance(w, torch.Tensor):
            return w.numel() * w.element_size()
        return getattr(w, "buffer", torch.empty(0)).numel()  # MKL's packed layout

    total = size(model.lm_head)
    for layer in model.layers:
        total += sum(size(w) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    return total


def _print_breakdowns(args: argparse.Namespace, engines: dict, vocab: int) -> None:
    from stepscope.engine.bench.latency_parts import breakdown_lines, decode_breakdown

    prompt = [(7919 * (i + 7)) % (vocab - 100) + 100 for i in range(args.prompt_tokens)]
    for label, llm in engines.items():
        if llm.config.scheduler_config.async_scheduling:
            print(f"where a decode step goes, {label}: not split (steps overlap)")
            continue
        parts = decode_breakdown(llm, prompt, args.output_tokens)
        print("\n".join(breakdown_lines(label, parts)))


def bench_latency(args: argparse.Namespace) -> None:
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.models.loader import load_config, resolve_model
    from stepscope.engine.sampling_params import SamplingParams

    quantizations = [None if q == "none" else q for q in args.quantization.split(",")]
    if args.breakdown and args.executor != "uni":
        raise SystemExit("--breakdown times the parts in this process: it needs --executor uni")
    settings = list(
        itertools.product(quantizations, args.dtype.split(","), args.async_scheduling.split(","))
    )
    vocab = load_config(resolve_model(args.model))["vocab_size"]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; model {args.model}; prompt {args.prompt_tokens} "
        f"tokens, {args.output_tokens} output tokens, greedy, {args.repeat} runs a setting"
    )
    bandwidth = memory_bandwidth_gbs()
    print(f"memory bandwidth (read, 512 MiB): {bandwidth:.1f} GB/s")
    engines = {}
    for quantization, dtype, async_ in settings:
        label = f"{quantization or 'none'}/{dtype}/async {async_}"
        llm = LLM(
            model=args.model,
            quantization=quantization,
            dtype=dtype,
            async_scheduling=async_ == "on",
            num_kv_blocks=64,
            executor=args.executor,
        )
        engines[label] = llm
        line = f"  {label}: {llm.config.model_config.weight_format}"
        if args.executor == "uni":
            read = weight_bytes_per_token(llm)
            line += (
                f", weights read a token {read / 1e6:.1f} MB, floor {read / bandwidth / 1e6:.2f} ms"
            )
        print(line)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    ttft: dict[str, list[float]] = {label: [] for label in engines}
    tpot: dict[str, list[float]] = {label: [] for label in engines}
    labels = list(engines)
    for run in range(args.repeat + 1):  # run 0 warms each engine up and is not counted
        order = labels if run % 2 else labels[::-1]
        for label in order:
            llm = engines[label]
            # A new prompt every run, the same for every setting within a run.
            seed = run * 131 + 1
            prompt = [(7919 * (seed + i)) % (vocab - 100) + 100 for i in range(args.prompt_tokens)]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([prompt], first, use_tqdm=False)
            t1 = time.perf_counter() - start
            llm.reset_prefix_cache()
            start = time.perf_counter()
            out = llm.generate([prompt], full, use_tqdm=False)
            tn = time.perf_counter() - start
            assert len(out[0].outputs[0].token_ids) == args.output_tokens
            if run:
                ttft[label].append(t1)
                tpot[label].append((tn - t1) / (args.output_tokens - 1))
    print(f"{'setting':34s} {'TTFT ms':>8s} {'ms/token':>9s} {'tok/s':>7s}  runs (ms/token)")
    for label in labels:
        per_token = statistics.median(tpot[label])
        runs = ", ".join(f"{t * 1e3:.2f}" for t in tpot[label])
        print(
            f"{label:34s} {statistics.median(ttft[label]) * 1e3:8.1f} {per_token * 1e3:9.2f} "
            f"{1 / per_token:7.1f}  {runs}"
        )
    base = labels[0]
    for label in labels[1:]:
        ratio = statistics.median(tpot[label]) / statistics.median(tpot[base])
        print(f"ratio ms/token {label} / {base}: {ratio:.2f}x")
    if args.breakdown:
        _print_breakdowns(args, engines, vocab)
    for llm in engines.values():
        llm.shutdown()
