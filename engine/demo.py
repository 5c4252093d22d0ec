"""`make demo`: a small sample workload on the default model, and what the engine did with it."""

from __future__ import annotations

import time

from stepscope.engine.llm import LLM
from stepscope.engine.sampling_params import SamplingParams

SAMPLE_CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences what a KV cache is.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? Answer briefly.",
]


def run_demo(model: str) -> None:
    print(f"loading {model} ...")
    llm = LLM(model=model)
    cfg = llm.config
    print(
        f"engine: block_size={cfg.block_size} kv_blocks={llm.client.num_kv_blocks} "
        f"budget={cfg.max_num_batched_tokens} tokens/step max_num_seqs={cfg.max_num_seqs} "
        f"prefix_caching={cfg.enable_prefix_caching} attention={cfg.attention_backend}"
    )
    params = SamplingParams(temperature=0.0, max_tokens=48)
    start = time.time()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in SAMPLE_CHATS], params)
    elapsed = time.time() - start
    total = 0
    for q, out in zip(SAMPLE_CHATS, outputs, strict=True):
        c = out.outputs[0]
        m = out.metrics
        total += len(c.token_ids)
        print(f"\n> {q}\n{c.text.strip()}")
        print(
            f"  [{len(out.prompt_token_ids)} prompt tokens, {m.num_cached_tokens} from prefix "
            f"cache; {len(c.token_ids)} generated, finish={c.finish_reason}; "
            f"queue {m.queue_time * 1e3:.0f} ms, TTFT {m.ttft * 1e3:.0f} ms]"
        )
    steps = llm.get_stats()["num_steps"]
    print(f"\n{total} tokens in {elapsed:.1f} s ({total / elapsed:.1f} tok/s) over {steps} steps")
