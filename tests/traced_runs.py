"""The real traced runs that several test modules read, each recorded once per test session by a
session fixture in tests/conftest.py; here, what each run was asked to do, for the tests that
check against it.

- TP=2 (`traced_tp2_run`): tiny-llama with every boundary a process boundary (API side,
  engine-core process, two workers), a KV pool small enough that requests queue, share a prefix,
  are chunked and get preempted. The dashboard's tests (tests/viz) and the span invariants
  (tests/traces/test_span_invariants.py) read it: the union of the two runs they once recorded
  apart, the dashboard's eight text prompts and the invariants' two token-id prompts.
- DP=2 (`traced_dp2_run`): two engine-core processes and the DP coordinator
  (tests/traces/test_trace_cli_ranks.py, tests/viz/test_engine_page_ranks.py).
- offline (`traced_offline_run`): `LLM` with every role in this process
  (tests/traces/test_trace_export.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

SHARED = "The quick brown fox jumps over the lazy dog. " * 6
TP2_TEXT_PROMPTS = [
    SHARED + f"Question {i}: " + "tell me about scheduling " * (i % 4) for i in range(8)
]
TP2_TOKEN_PROMPTS = [list(range(100, 140)), list(range(200, 210))]
TP2_PROMPTS: list[str | list[int]] = [*TP2_TEXT_PROMPTS, *TP2_TOKEN_PROMPTS]
TP2_MAX_TOKENS = [12] * len(TP2_TEXT_PROMPTS) + [5] * len(TP2_TOKEN_PROMPTS)

DP2_PROMPTS = [f"Prompt {i}: tell me about scheduling " * (1 + i % 3) for i in range(8)]
# Long enough (about a second of decoding) that the DP coordinator, which publishes the latest
# loads at most every 100 ms, publishes some while requests run, even when a loaded machine
# starves it for a few hundred milliseconds (with 8 tokens it once saw only idle ranks).
DP2_MAX_TOKENS = 32

OFFLINE_PROMPTS = [
    "Hi",
    "Tell me about the scheduler of a serving engine",
    "one two three four five six seven eight nine ten " * 4,
    "Why does prefill take longer than decode, and what is chunked prefill?",
]
OFFLINE_MAX_TOKENS = 8

_DESCRIBE = """
SELECT (SELECT count(*) FROM requests) AS requests,
       (SELECT count(*) FROM steps) AS steps,
       (SELECT sum(num_preempted) FROM steps) AS preemptions,
       (SELECT sum(prefix_hit_tokens) FROM steps) AS prefix_hit_tokens,
       (SELECT count(DISTINCT rank) FROM worker_steps) AS workers,
       (SELECT count(DISTINCT boundary) FROM crossings) AS boundaries,
       (SELECT max(num_prefill_tokens) FROM steps) AS max_prefill
"""


class TracedRun(NamedTuple):
    """A recorded trace file and what the run did (counts read back from it)."""

    path: str
    info: dict[str, Any]


def _greedy(max_tokens: int) -> Any:
    from stepscope.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def record_tp2_trace(path: Path) -> TracedRun:
    """TP2_PROMPTS in one batch, greedy to TP2_MAX_TOKENS each, on 14 KV blocks of 16 tokens
    and a 64-token budget; checks that the run did what its readers rely on."""
    from stepscope.engine.entrypoints.llm import LLM
    from stepscope.traces.backend.store import TraceStore

    with LLM(
        model="tiny-llama",
        executor="mp",
        tensor_parallel_size=2,
        num_kv_blocks=14,
        max_num_batched_tokens=64,
        trace_db=path,
    ) as llm:
        params = [_greedy(m) for m in TP2_MAX_TOKENS]
        llm.generate(TP2_PROMPTS, params, use_tqdm=False)
    with TraceStore(path, read_only=True) as store:
        info: dict[str, Any] = {k: int(v) for k, v in store.query(_DESCRIBE)[0].items()}
        preempted = store.query(
            "SELECT request_id, num_preemptions FROM requests WHERE num_preemptions > 0 "
            "ORDER BY start_ns LIMIT 1"
        )
    if preempted:
        info["preempted_request"] = preempted[0]["request_id"]
        info["preempted_times"] = int(preempted[0]["num_preemptions"])
    assert info["requests"] == len(TP2_PROMPTS) and info["workers"] == 2, info
    assert info["boundaries"] == 4, info
    assert info["preemptions"] > 0 and info["prefix_hit_tokens"] > 0, info
    assert "preempted_request" in info, "a preemption must show on its request span"
    return TracedRun(str(path), info)


def record_dp2_trace(path: Path) -> str:
    """tiny-llama with data_parallel_size=2 (in-process executor in each engine core),
    DP2_PROMPTS greedy to DP2_MAX_TOKENS each."""
    from stepscope.engine.entrypoints.llm import LLM

    with LLM(
        model="tiny-llama",
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        data_parallel_size=2,
        executor="uni",
        trace_db=path,
    ) as llm:
        llm.generate(DP2_PROMPTS, _greedy(DP2_MAX_TOKENS), use_tqdm=False)
    return str(path)


def record_offline_trace(path: Path) -> str:
    """tiny-llama in this process (API, engine core and worker in one), OFFLINE_PROMPTS greedy
    to OFFLINE_MAX_TOKENS each, with a 32-token budget."""
    from stepscope.engine.entrypoints.llm import LLM

    with LLM(model="tiny-llama", trace_db=path, num_kv_blocks=64, max_num_batched_tokens=32) as llm:
        llm.generate(OFFLINE_PROMPTS, _greedy(OFFLINE_MAX_TOKENS), use_tqdm=False)
    return str(path)
