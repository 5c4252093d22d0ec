"""`stepscope trace replay`: a recorded run's workload sent again to a fresh engine that runs the
recorded configuration with only the options given changed, recorded into a new trace.

The workload is read from the trace (traces/backend/workload.py). Each request arrives at its
recorded offset, with its recorded prompt ids (where `--trace-content` kept them) or ids made
from its prompt's block hashes (the same shared prefixes, so the prefix cache hits as it did),
its recorded sampling parameters, and its output length forced: `max_tokens` is the number of
tokens it generated, with `ignore_eos` and no stop strings or stop ids. A request that generated
nothing is left out.

The entry path is the recording's. An offline run replays through `LLM` in this process: each
request is added to the engine when its time comes, as `LLM.generate` adds a batch at once, and
the request's arrival time is its recorded offset even when a step was running then (it waits
for the step's end, as a request to a busy server waits for the next schedule). A served run
replays through a `stepscope serve` started here with flags generated from the configuration,
stopped cleanly at the end, or through a server already running (`url`), over streamed
/v1/completions as `bench serve` sends them (serve_client.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from stepscope.engine.config import EngineConfig
from stepscope.engine.engine_args import engine_option_names, parse_engine_option
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names
from stepscope.traces.backend.units import format_seconds
from stepscope.traces.backend.workload import (
    RecordedRequest,
    Workload,
    load_workload,
    synthetic_prompts,
)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One recorded request as it is sent again."""

    recorded: RecordedRequest
    prompt: list[int]  # token ids, `recorded.input_tokens` of them
    params: SamplingParams  # the recorded ones, n = 1, the output length forced


@dataclass(frozen=True, slots=True)
class ReplayResult:
    entry: str  # "offline" | "serve"
    changes: dict[str, Any]  # the options changed from the recorded ones
    replayed: int  # requests sent
    skipped: int  # recorded requests that generated nothing, left out
    failed: list[str]  # served replays: the error of each request that failed
    duration_s: float  # first arrival to last output
    trace: str | None  # the new trace; None: a running server's own


def parse_changes(sets: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings as engine options: each key an `EngineConfig` option's flat name,
    each value parsed to its type."""
    changes: dict[str, Any] = {}
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(
                f"--set takes KEY=VALUE (an engine option and its value), got {item!r}"
            )
        if key.strip() == "trace_db":
            raise ValueError("--set trace_db: the new trace is where -o says")
        changes[key.strip()] = parse_engine_option(key.strip(), text.strip())
    return changes


def replay_options(workload: Workload, changes: dict[str, Any], trace_db: str | None) -> dict:
    """The new engine's options by flat name: the recorded ones with `changes` over them, and
    the new trace file; validated as `EngineConfig.create` validates (ValueError naming the
    option)."""
    known = set(engine_option_names())
    options: dict[str, Any] = {}
    for part in workload.engine_config.values():
        if isinstance(part, dict):
            options.update({k: v for k, v in part.items() if k in known})
    options.update(changes)
    if trace_db is not None:
        options["trace_db"] = trace_db
    EngineConfig.create(**options, offline=workload.entry == names.ENTRY_OFFLINE)
    return options


def forced_params(recorded: RecordedRequest) -> SamplingParams:
    """The recorded sampling parameters, one sequence, exactly the recorded output length."""
    fields = {k: v for k, v in recorded.sampling.items() if k in SamplingParams.__struct_fields__}
    fields.update(
        n=1, max_tokens=recorded.output_tokens, min_tokens=0, ignore_eos=True, stop=[],
        stop_token_ids=[],
    )  # fmt: skip
    return msgspec.convert(fields, SamplingParams, strict=False)


def plan(workload: Workload, vocab_size: int) -> tuple[list[ReplayRequest], int]:
    """The requests to send, by arrival, and how many recorded ones are left out."""
    requests, skipped = [], 0
    for recorded, prompt in zip(
        workload.requests, synthetic_prompts(workload, vocab_size), strict=True
    ):
        if recorded.output_tokens < 1 or recorded.input_tokens < 1:
            skipped += 1
            continue
        requests.append(ReplayRequest(recorded, prompt, forced_params(recorded)))
    return requests, skipped


# ---- offline: through LLM, each request added when its time comes ----------------------------
def replay_offline(workload: Workload, options: dict[str, Any]) -> tuple[int, int, float]:
    """(replayed, skipped, seconds) of the workload through a fresh `LLM(**options)`."""
    from stepscope.engine.entrypoints.llm import LLM

    with LLM(**options) as llm:
        requests, skipped = plan(workload, llm.processor.vocab_size)
        for r in requests:  # all refused or none, before the first one is sent
            llm.processor.process(r.recorded.request_id, r.prompt, r.params)
        return len(requests), skipped, _drive(llm, requests)


def _drive(llm: Any, requests: list[ReplayRequest]) -> float:
    """Add each request at its offset and step the engine until every one has finished, as
    `LLM._run` does for a batch that arrives at once (with its steps `send` and `collect`)."""
    frontend = llm.frontend
    pending = deque(requests)
    start = time.time()
    try:
        while pending or frontend.requests:
            while pending and start + pending[0].recorded.arrival_s <= time.time():
                r = pending.popleft()
                arrival = start + r.recorded.arrival_s
                parent = frontend.make_request(r.recorded.request_id, r.prompt, r.params, arrival)
                llm.send(parent, r.recorded.operation)
            if not frontend.requests:  # idle until the next arrival
                time.sleep(max(0.0, start + pending[0].recorded.arrival_s - time.time()))
                continue
            for out in llm.collect():  # whole outputs: each is a finished request
                frontend.release(out.request_id)
    except BaseException:
        llm.abort_unfinished()
        raise
    return time.time() - start


# ---- served: through a server, over streamed /v1/completions ----------------------------------
def replay_served(
    workload: Workload,
    options: dict[str, Any] | None,
    url: str | None = None,
    api_key: str | None = None,
) -> tuple[int, int, list[str], float]:
    """(replayed, skipped, errors, seconds) of the workload through a `stepscope serve` started
    with `options` (and stopped at the end), or through the server at `url`."""
    from stepscope.engine.engine_args import engine_flags
    from stepscope.engine.entrypoints.serve import ServerProcess
    from stepscope.engine.models.loader import load_config, resolve_model

    model = str(workload.engine_config["model_config"]["model"])
    tokenizer = workload.engine_config["model_config"].get("tokenizer") or model
    requests, skipped = plan(workload, load_config(resolve_model(tokenizer))["vocab_size"])
    server = None
    if url is None:
        assert options is not None
        server = ServerProcess(*engine_flags(options))
        url = server.url
    try:
        results, seconds = asyncio.run(_send_all(url, requests, api_key))
    finally:
        if server is not None:
            server.stop()  # SIGINT, as Ctrl-C: the server flushes and closes its trace
    errors = [res.error for res in results if not res.success]
    for r, res in zip(requests, results, strict=True):
        if res.success and res.output_tokens != r.params.max_tokens:
            errors.append(
                f"request {r.recorded.request_id}: {res.output_tokens} tokens generated, "
                f"{r.params.max_tokens} asked for"
            )
    return len(requests), skipped, errors, seconds


async def _send_all(
    url: str, requests: list[ReplayRequest], api_key: str | None
) -> tuple[list[Any], float]:
    import httpx

    from stepscope.engine.bench.serve_client import (
        CompletionStreams,
        served_model,
        stream_completion,
    )

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers) as client:
        model = await served_model(client)
    async with CompletionStreams(url, headers) as streams:
        start = time.perf_counter()

        async def send(index: int, r: ReplayRequest) -> Any:
            await asyncio.sleep(max(0.0, start + r.recorded.arrival_s - time.perf_counter()))
            return await stream_completion(
                streams, model, index, r.prompt, r.params.max_tokens, completion_body(r.params)
            )

        results = await asyncio.gather(*(send(i, r) for i, r in enumerate(requests)))
        return list(results), time.perf_counter() - start


def completion_body(params: SamplingParams) -> dict[str, Any]:
    """The /v1/completions fields that ask for these sampling parameters (n = 1, forced
    length: `max_tokens` and `ignore_eos` are set by the caller)."""
    body: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "min_tokens": params.min_tokens,
        "ignore_eos": True,
        "skip_special_tokens": params.skip_special_tokens,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
    }
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if params.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return body


# ---- the command ---------------------------------------------------------------------------
def replay(
    trace: str,
    sets: list[str],
    output: str | None,
    url: str | None = None,
    api_key: str | None = None,
) -> ReplayResult:
    """Replay the workload recorded in `trace` with the options `sets` changes, into the new
    trace `output` (or against the running server at `url`, which records it in its own)."""
    if url is not None:
        if sets or output:
            raise ValueError(
                "--url replays against a running server: its settings and its trace file are "
                "its own, so --set and -o do not apply"
            )
    elif not output:
        raise ValueError("give -o NEW.duckdb, the trace file the replay records")
    elif os.path.exists(output):
        raise ValueError(f"{output} exists: the replay records into a new trace file")
    changes = parse_changes(sets)
    workload = load_workload(trace)
    options = None if url is not None else replay_options(workload, changes, output)
    if not workload.requests:
        raise ValueError(f"{trace} holds no requests to replay")
    failed: list[str] = []
    if url is not None:
        replayed, skipped, failed, seconds = replay_served(workload, None, url, api_key)
        return ReplayResult(names.ENTRY_SERVE, {}, replayed, skipped, failed, seconds, None)
    assert options is not None
    if workload.entry == names.ENTRY_OFFLINE:
        replayed, skipped, seconds = replay_offline(workload, options)
    else:
        replayed, skipped, failed, seconds = replay_served(workload, options)
    return ReplayResult(workload.entry, changes, replayed, skipped, failed, seconds, output)


def format_result(result: ReplayResult) -> str:
    how = "offline, through LLM" if result.entry == names.ENTRY_OFFLINE else "served"
    changed = ", ".join(f"{k}={v}" for k, v in result.changes.items()) or "nothing"
    lines = [
        f"replayed {result.replayed} requests ({how}; changed: {changed}) in "
        f"{format_seconds(result.duration_s)}"
    ]
    if result.skipped:
        lines.append(f"left out {result.skipped} recorded requests that generated no token")
    if result.failed:
        lines.append(f"{len(result.failed)} failed; the first: {result.failed[0]}")
    where = result.trace or "the server's own trace file (its --trace-db)"
    lines.append(f"new trace: {where}")
    return "\n".join(lines)


def trace_replay(args: argparse.Namespace) -> int:
    result = replay(args.path, args.sets, args.output, args.url, args.api_key)
    print(format_result(result), flush=True)
    return 1 if result.failed else 0
