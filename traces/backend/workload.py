"""A recorded run's workload, read back from its trace: what `stepscope trace replay` sends
again and what `stepscope trace whatif` simulates.

Each request's arrival offset, its time on the API side before and after the engine core, its
lengths, prefix-cache hits, sampling parameters and the chained hashes of its prompt's full KV
blocks (`stepscope.prompt_block_hashes`), plus the run's whole engine configuration and entry
path (the `stepscope.run` span). `synthetic_prompts` turns the hashes back into token ids that
share exactly the blocks the recorded prompts shared, so a replay meets the prefix cache as the
recording did without the trace holding any prompt (the ids themselves are recorded only under
`--trace-content`). `check_one_run` refuses a trace file that several runs were given (each
appends to it): every reader of a recorded run calls it. Pure trace reading: nothing here
imports the engine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

from stepscope.traces import names as n
from stepscope.traces.backend.source import Queryable, open_trace
from stepscope.traces.backend.views import dp_rank_sql


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request as its trace recorded it."""

    request_id: str
    arrival_s: float  # request span start, seconds after the first request's start
    before_engine_s: float  # queued event - span start (API side, before the engine core)
    after_engine_s: float  # span end - finished event
    input_tokens: int
    output_tokens: int
    cached_tokens: int  # prefix-cache hit tokens as recorded
    # One per FULL block of the prompt, chained: two prompts share their first k blocks exactly
    # when their first k hashes are equal.
    block_hashes: tuple[str, ...]
    prompt_token_ids: tuple[int, ...] | None  # only where recorded under --trace-content
    sampling: dict  # the request's SamplingParams fields as recorded
    operation: str  # "chat" | "text_completion"
    dp_rank: int
    ttft_s: float | None
    e2e_s: float


@dataclass(frozen=True, slots=True)
class Workload:
    """A recorded run: its requests by arrival, its configuration and how requests came in."""

    requests: tuple[RecordedRequest, ...]  # by arrival
    engine_config: dict  # the recorded EngineConfig, msgspec.to_builtins form (nested parts)
    entry: str  # "offline" | "serve"
    block_size: int  # the block size the hashes were taken at


# Read from the `spans` table, which every trace file has, so that a trace recorded before the
# `stepscope.run` span existed is told apart from one that is no trace at all.
_RUN = f"""
SELECT json_extract_string(attributes, '$."{n.ENGINE_CONFIG}"') AS engine_config,
       json_extract_string(attributes, '$."{n.ENTRY}"') AS entry
FROM spans WHERE name = '{n.RUN}' ORDER BY start_ns LIMIT 1
"""

_REQUESTS = """
SELECT request_id, start_ns, end_ns, queued_ns, finished_ns, input_tokens, output_tokens,
       cached_tokens, prompt_block_hashes, CAST(sampling_params AS VARCHAR) AS sampling_params,
       prompt_token_ids, operation, dp_rank, ttft_s, e2e_s
FROM requests WHERE request_id IS NOT NULL
ORDER BY start_ns, queued_ns NULLS LAST, span_id
"""


# ---- one run per trace -------------------------------------------------------------------------
# Every front end's `stepscope.run` span (one per API server), and every engine core's first
# step (one per DP rank): the two ways a second run given the same trace file shows.
_RUN_SPANS = f"""
SELECT start_ns, json_extract_string(attributes, '$."{n.ENGINE_CONFIG}"') AS engine_config,
       CAST(json_extract(resource, '$."{n.PROCESS_PID}"') AS BIGINT) AS pid
FROM spans WHERE name = '{n.RUN}' ORDER BY start_ns
"""
_FIRST_STEPS = f"""
SELECT {dp_rank_sql()} AS dp_rank, start_ns FROM spans
WHERE name = '{n.ENGINE_STEP}' AND CAST(json_extract(attributes, '$."{n.STEP}"') AS BIGINT) = 0
ORDER BY start_ns
"""


def run_starts(source: Queryable) -> list[int]:
    """When each run recorded in the trace started (ns since the epoch; empty: no run span and
    no first step). Runs given the same trace file are appended to it, one after the other.
    Run spans from different processes with the same configuration are one run (the API
    servers of one deployment); one process starting again, or another configuration, is
    another run. An engine core's step 0 seen again on a DP rank is another run too (the
    start of the latest run span before it)."""
    spans = source.df(_RUN_SPANS)
    groups: list[tuple[int, str | None, set[int | None]]] = []
    for start, config, pid in spans.itertuples(index=False):
        pid = None if _null(pid) else int(pid)
        if groups and config == groups[-1][1] and pid is not None and pid not in groups[-1][2]:
            groups[-1][2].add(pid)
        else:
            groups.append((int(start), config, {pid}))
    starts = [g[0] for g in groups]
    firsts = source.df(_FIRST_STEPS)
    by_rank = firsts.groupby("dp_rank")["start_ns"].apply(list) if len(firsts) else []
    engine = max(by_rank, key=len, default=[])
    if len(engine) > len(starts):
        span_starts = np.array([g[0] for g in groups], dtype=np.int64)
        before = span_starts.searchsorted(np.array(engine, dtype=np.int64), "right") - 1
        found = [
            int(span_starts[i]) if i >= 0 else int(s) for i, s in zip(before, engine, strict=True)
        ]
        starts = found if len(set(found)) == len(found) else [int(s) for s in engine]
    return starts


def recorded_pool(source: Queryable) -> int | None:
    """The KV pool the run's steps saw, in blocks (None: no step recorded it)."""
    blocks = source.df("SELECT max(kv_total_blocks) AS blocks FROM steps")["blocks"]
    return None if blocks.isna().all() else int(blocks.iloc[0])


def check_one_run(source: Queryable, label: str = "this trace") -> None:
    """ValueError when the trace holds several runs (`run_starts`): their requests and steps
    would be read as one run's (request ids repeat, times go backwards)."""
    starts = run_starts(source)
    if len(starts) < 2:
        return
    when = ", ".join(datetime.fromtimestamp(s / 1e9).strftime("%Y-%m-%d %H:%M:%S") for s in starts)
    raise ValueError(
        f"{label} holds {len(starts)} runs, started at {when} (each run given the same trace "
        "file appends its spans to it), and their requests cannot be told apart: record each "
        "run to its own file (a new trace_db / --trace-db path per run)"
    )


def load_workload(source: str | Queryable) -> Workload:
    """The workload of a trace file, a running collector's URL, or an open `Queryable`. A trace
    without the recorded configuration raises ValueError."""
    if isinstance(source, str):
        with open_trace(source) as opened:
            return _load(opened, source)
    return _load(source, "this trace")


def _load(source: Queryable, label: str) -> Workload:
    check_one_run(source, label)
    run = source.df(_RUN)
    if run.empty or run.engine_config[0] is None:
        raise ValueError(
            f"{label} holds no recorded engine configuration (no {n.RUN} span): it was recorded "
            "before replay existed; record it again with this version of stepscope"
        )
    config = json.loads(run.engine_config[0])
    rows = source.df(_REQUESTS)
    first_ns = int(rows.start_ns.min()) if len(rows) else 0
    requests = tuple(_request(row, first_ns) for row in rows.to_dict("records"))
    return Workload(
        requests=requests,
        engine_config=config,
        entry=run.entry[0] or n.ENTRY_OFFLINE,
        block_size=int(config["cache_config"]["block_size"]),
    )


def _request(row: dict[str, Any], first_ns: int) -> RecordedRequest:
    start, end = int(row["start_ns"]), int(row["end_ns"])
    queued, finished = _int(row["queued_ns"]), _int(row["finished_ns"])
    ids = _seq(row["prompt_token_ids"])
    sampling = row["sampling_params"]
    return RecordedRequest(
        request_id=str(row["request_id"]),
        arrival_s=(start - first_ns) / 1e9,
        before_engine_s=0.0 if queued is None else (queued - start) / 1e9,
        after_engine_s=0.0 if finished is None else (end - finished) / 1e9,
        input_tokens=_int(row["input_tokens"]) or 0,
        output_tokens=_int(row["output_tokens"]) or 0,
        cached_tokens=_int(row["cached_tokens"]) or 0,
        block_hashes=tuple(str(h) for h in _seq(row["prompt_block_hashes"]) or ()),
        prompt_token_ids=None if ids is None else tuple(int(t) for t in ids),
        sampling=json.loads(sampling) if isinstance(sampling, str) else {},
        operation=str(row["operation"] or n.OPERATION_TEXT_COMPLETION),
        dp_rank=_int(row["dp_rank"]) or 0,
        ttft_s=_float(row["ttft_s"]),
        e2e_s=_float(row["e2e_s"]) or 0.0,
    )


def synthetic_prompts(workload: Workload, vocab_size: int) -> list[list[int]]:
    """Token ids for every request, `input_tokens` long: the recorded ids where the trace holds
    them, else ids made from the block hashes. Equal hashes give equal blocks of tokens, so the
    prompts share exactly the full blocks the recorded ones shared; the partial last block, and
    any block without a hash, is unique to its request. Ids are in [1, vocab_size)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    size = workload.block_size
    prompts = []
    for index, req in enumerate(workload.requests):
        recorded = req.prompt_token_ids
        if recorded is not None and len(recorded) == req.input_tokens:
            prompts.append(list(recorded))
            continue
        tokens: list[int] = []
        for start in range(0, req.input_tokens, size):
            length = min(size, req.input_tokens - start)
            block = start // size
            if length == size and block < len(req.block_hashes):
                seed: str | int = int(req.block_hashes[block], 16)
            else:
                seed = f"{index}/{req.request_id}/{block}"  # no other request has this block
            tokens += _block_tokens(seed, length, vocab_size)
        prompts.append(tokens)
    return prompts


def _block_tokens(seed: str | int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab_size) for _ in range(length)]


def _null(value: Any) -> bool:
    """NULL as pandas gives it: None, NaN or NA."""
    return value is None or (not isinstance(value, Sequence | np.ndarray) and bool(pd.isna(value)))


def _seq(value: Any) -> Sequence | None:
    return None if _null(value) else list(value)


def _int(value: Any) -> int | None:
    return None if _null(value) else int(value)


def _float(value: Any) -> float | None:
    return None if _null(value) else float(value)
