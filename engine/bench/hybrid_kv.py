"""`stepscope bench hybrid-kv`: what the hybrid KV cache manager buys a model with
sliding-window layers, in one KV pool of fixed bytes.

The same requests (long random prompts, forced output lengths, greedy) run twice in the same
pool, once with the hybrid manager (a block table per KV cache group; the sliding-window groups
give back the blocks their window has left behind) and once with it disabled
(`disable_hybrid_kv_cache_manager`: one table, every layer keeps every block). The pool's bytes
are fixed by `--pool-requests`: enough for that many requests whole with every layer keeping
every block. A block holds one group's layers, so the same bytes are `num_layers / group_size`
times more blocks with the manager on (the null block included in them). Per setting it reads
back from the run's trace the most requests running at once and the blocks each group held at
its peak, counts preemptions, and times the run: output tokens/s and all tokens/s. The settings
take turns over `--repeat` rounds (the first order reversed every other round).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Setting:
    label: str
    disable_hybrid: bool
    num_kv_blocks: int
    seconds: list[float] = field(default_factory=list)
    max_running: int = 0
    peak_blocks_by_group: list[int] = field(default_factory=list)
    group_windows: list[int] = field(default_factory=list)
    preemptions: int = 0


def pool_blocks(shape, pool_requests: int, tokens: int, block_size: int) -> dict[bool, int]:
    """num_kv_blocks with the hybrid manager on (False) and off (True) for the same bytes: the
    pool holds `pool_requests` requests of `tokens` tokens with every layer keeping every
    block."""
    from stepscope.engine.core.kv_cache_utils import kv_cache_groups_for, kv_group_size

    groups = kv_cache_groups_for(shape)
    if len(groups) == 1:
        raise SystemExit(
            f"the model's layers all attend the same way ({shape.model_type}): it has one KV "
            "cache group, and the hybrid manager changes nothing; try --model gemma-3-270m"
        )
    layer_blocks = pool_requests * -(-tokens // block_size) * shape.num_layers
    return {False: layer_blocks // kv_group_size(groups), True: layer_blocks // shape.num_layers}


def _run(setting: Setting, args: argparse.Namespace, prompts: list[list[int]], folder: Path):
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.sampling_params import SamplingParams
    from stepscope.traces.backend.source import open_trace

    trace = folder / f"{setting.label.replace(' ', '_')}-{len(setting.seconds)}.duckdb"
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    with LLM(
        model=args.model,
        num_kv_blocks=setting.num_kv_blocks,
        disable_hybrid_kv_cache_manager=setting.disable_hybrid,
        max_num_seqs=len(prompts),
        block_size=args.block_size,
        trace_db=str(trace),
    ) as llm:
        llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        before = llm.get_stats()["num_preemptions"]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        setting.seconds.append(time.perf_counter() - start)
        setting.preemptions = llm.get_stats()["num_preemptions"] - before
        assert all(len(o.outputs[0].token_ids) == args.output_tokens for o in outs)
    with open_trace(str(trace)) as source:
        steps = source.df("SELECT num_running, kv_blocks_by_group, kv_group_windows FROM steps")
    setting.max_running = int(steps["num_running"].max())
    by_group = [list(v) for v in steps["kv_blocks_by_group"] if v is not None]
    setting.peak_blocks_by_group = [max(col) for col in zip(*by_group, strict=True)]
    windows = next((v for v in steps["kv_group_windows"] if v is not None), [])
    setting.group_windows = [int(w) for w in windows]


def _groups_text(setting: Setting) -> str:
    parts = []
    for peak, window in zip(setting.peak_blocks_by_group, setting.group_windows, strict=False):
        parts.append(f"{peak} (window {window})" if window else f"{peak} (full)")
    return ", ".join(parts)


def bench_hybrid_kv(args: argparse.Namespace) -> None:
    from stepscope.engine.models.config import ModelShape
    from stepscope.engine.models.loader import load_config, resolve_model

    if min(args.num_requests, args.prompt_tokens, args.output_tokens, args.pool_requests) < 1:
        raise SystemExit("--num-requests, --prompt-tokens, --output-tokens, --pool-requests: >= 1")
    shape = ModelShape.from_hf_config(load_config(resolve_model(args.model)))
    tokens = args.prompt_tokens + args.output_tokens
    blocks = pool_blocks(shape, args.pool_requests, tokens, args.block_size)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, shape.vocab_size) for _ in range(args.prompt_tokens)]
        for _ in range(args.num_requests)
    ]
    settings = [
        Setting("hybrid", False, blocks[False]),
        Setting("disabled", True, blocks[True]),
    ]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus; model {args.model} "
        f"({shape.num_layers} layers, window {shape.sliding_window}); {args.num_requests} "
        f"requests of {args.prompt_tokens} prompt + {args.output_tokens} output tokens, greedy; "
        f"the pool holds {args.pool_requests} of them whole: {blocks[True]} blocks of every "
        f"layer, or {blocks[False]} blocks of one group's layers"
    )
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-kv-") as tmp:
        for rnd in range(args.repeat):
            for setting in settings if rnd % 2 == 0 else settings[::-1]:
                _run(setting, args, prompts, Path(tmp))
                seconds = setting.seconds[-1]
                print(
                    f"  {setting.label} run {rnd + 1}: {seconds:.1f} s, "
                    f"{args.num_requests * args.output_tokens / seconds:.1f} output tok/s",
                    flush=True,
                )
    print(f"{'setting':10s} {'blocks':>7s} {'at once':>8s} {'preempt':>8s} {'out tok/s':>10s} "
          f"{'all tok/s':>10s}  peak blocks by group")  # fmt: skip
    rates = {}
    for s in settings:
        total = sum(s.seconds)
        out = args.num_requests * args.output_tokens * len(s.seconds) / total
        rates[s.label] = out
        every = args.num_requests * tokens * len(s.seconds) / total
        print(
            f"{s.label:10s} {s.num_kv_blocks:7d} {s.max_running:8d} {s.preemptions:8d} "
            f"{out:10.1f} {every:10.1f}  {_groups_text(s)}"
        )
    hybrid, disabled = settings
    print(
        f"ratio hybrid / disabled: {hybrid.max_running / max(disabled.max_running, 1):.2f}x "
        f"requests at once, {rates['hybrid'] / rates['disabled']:.2f}x output tok/s"
    )
