"""`stepscope bench accuracy`: a model's quantized weights against the same weights dequantized,
in float32, over prompts of real text.

Two engines on one checkpoint: the reference with quantization=None and dtype float32 (the
GGUF's blocks dequantized, as transformers reads them), and the quantized one (the blocks as
they are, activations in --dtype, for steps of every size: quantized_max_tokens=None). For
each prompt, 256 greedy tokens from each:
- the position of the first token where they differ (none: they agree throughout);
- teacher forcing: the reference's own sequence (prompt and output) fed to both as a prompt,
  with prompt_logprobs=1: at each output position, whether both put the same token first (top-1
  agreement), and how far apart the log-probabilities of the reference's token are (the
  logits' difference after each row is normalised, which is what sampling sees).
"""

from __future__ import annotations

import argparse
import statistics

PROMPTS = [
    "The history of the Roman Empire began",
    "Write a short poem about the sea.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Explain why the sky is blue to a ten-year-old.",
    "Les montagnes de Suisse sont",
    "List three ways to keep a sourdough starter alive:",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "Q: What is the capital of Australia?\nA:",
    "In a distant galaxy, a small robot named Pip",
    "Summarise the rules of chess in a paragraph.",
]


def bench_accuracy(args: argparse.Namespace) -> None:
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.engine.sampling_params import SamplingParams

    if not 1 <= args.num_prompts <= len(PROMPTS):
        raise SystemExit(f"--num-prompts: 1 to {len(PROMPTS)}")
    prompts = PROMPTS[: args.num_prompts]
    engines = {
        "reference": LLM(model=args.model, quantization=None, dtype="float32"),
        # Every step through the quantized blocks, prompts too (no dense copy above a size).
        "quantized": LLM(
            model=args.model, quantization="gguf", dtype=args.dtype, quantized_max_tokens=None
        ),
    }
    for name, llm in engines.items():
        m = llm.config.model_config
        print(f"{name}: {m.weight_format}, dtype {m.dtype}")
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    outputs = {
        name: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        for name, llm in engines.items()
    }
    tokenizer = engines["reference"].tokenizer
    forced = [
        tokenizer(p, add_special_tokens=False)["input_ids"] + list(out)
        for p, out in zip(prompts, outputs["reference"], strict=True)
    ]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    logprobs = {
        name: [o.prompt_logprobs for o in llm.generate(forced, score, use_tqdm=False)]
        for name, llm in engines.items()
    }
    agree = total = 0
    gaps: list[float] = []
    header = ("prompt", "first differing token", "top-1 agreement", "max |dlogprob|")
    print(f"{header[0]:>6s} {header[1]:>22s} {header[2]:>16s} {header[3]:>15s}")
    for i, sequence in enumerate(forced):
        ref, quant = outputs["reference"][i], outputs["quantized"][i]
        first = next((j for j, (a, b) in enumerate(zip(ref, quant, strict=True)) if a != b), None)
        start = len(sequence) - len(ref)  # the output's positions in the forced sequence
        hits = gap = 0.0
        for pos in range(start, len(sequence)):
            r, q = logprobs["reference"][i][pos], logprobs["quantized"][i][pos]
            token = sequence[pos]  # the reference's greedy choice: its top-1 here
            hits += max(q, key=q.get) == max(r, key=r.get)
            gap = max(gap, abs(r[token] - q[token]))
            gaps.append(abs(r[token] - q[token]))
        agree += int(hits)
        total += len(ref)
        where = "none (all equal)" if first is None else str(first)
        print(f"{i:6d} {where:>22s} {hits / len(ref):16.1%} {gap:15.3f}")
    print(
        f"all: top-1 agreement {agree / total:.2%} over {total} positions; "
        f"|dlogprob| of the reference's token: median {statistics.median(gaps):.4f}, "
        f"max {max(gaps):.3f}"
    )
    for llm in engines.values():
        llm.shutdown()
