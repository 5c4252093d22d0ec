"""`stepscope bench soak`: rounds of load, faults and hostile input against a running server,
checking after each round that the server is whole again.

Each round runs, against a server with a small KV pool (so that requests preempt each other):
  1. many concurrent greedy streams (they must all finish, with [DONE] and no error event);
  2. streams cut by the client after a few chunks (disconnects), and non-streaming requests the
     client gives up on (aborts): the server must free their requests and blocks;
  3. hostile bodies: each must get a 4xx in OpenAI's error shape, never a 5xx or a hang;
  4. a greedy canary request, amid the load and after it, whose tokens must equal those it got
     on the quiet server before the first round.
Then it waits for the server to settle: running and waiting requests and KV usage back to zero.
It prints what held in each round and exits non-zero if anything did not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from stepscope.engine.bench.serve_client import (
    CompletionStreams,
    served_model,
    stream_completion,
)

CANARY_PROMPT = "The soak canary: count the stars one by one, and say"
HOSTILE_BODIES: list[tuple[str, dict]] = [
    ("max_tokens beyond the context", {"prompt": "x", "max_tokens": 10**9}),
    ("prompt beyond the context", {"prompt": "x" * 200_000, "max_tokens": 5}),
    ("negative token ids", {"prompt": [[-5, 3]], "max_tokens": 5}),
    ("token ids beyond the vocabulary", {"prompt": [10**9], "max_tokens": 5}),
    ("n = a million", {"prompt": "x", "n": 10**6}),
    ("logprobs = a million", {"prompt": "x", "logprobs": 10**6}),
    ("lone surrogate", {"prompt": "\ud800 broken surrogate"}),
    ("temperature NaN", {"prompt": "x", "temperature": float("nan")}),
    ("top_p infinity", {"prompt": "x", "top_p": float("inf")}),
    ("logit_bias beyond the vocabulary", {"prompt": "x", "logit_bias": {"99999999": 5}}),
    ("logit_bias of 1000", {"prompt": "x", "logit_bias": {"5": 1000}}),
    ("seed beyond 64 bits", {"prompt": "x", "seed": 10**30}),
    ("empty prompt", {"prompt": []}),
    ("prompt of the wrong type", {"prompt": {"text": "x"}}),
    ("chat without messages", {"messages": []}),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("unknown model", {"prompt": "x", "model": "no-such-model"}),
]
SETTLE_TIMEOUT_S = 60.0


@dataclass(slots=True)
class RoundReport:
    index: int
    streams_ok: int = 0
    streams_sent: int = 0
    disconnects: int = 0
    aborts: int = 0
    hostile_4xx: int = 0
    hostile_sent: int = 0
    canary_same: bool | None = None
    preemptions: int = 0
    settled: dict[str, float] = field(default_factory=dict)
    settle_s: float = 0.0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return not self.problems

    def line(self) -> str:
        canary = {None: "recorded", True: "unchanged", False: "CHANGED"}[self.canary_same]
        state = ", ".join(f"{k} {v:g}" for k, v in self.settled.items())
        return (
            f"round {self.index}: {self.streams_ok}/{self.streams_sent} streams finished, "
            f"{self.preemptions} preemptions, {self.disconnects} disconnects, "
            f"{self.aborts} aborts, "
            f"{self.hostile_4xx}/{self.hostile_sent} hostile bodies refused with a 4xx, "
            f"canary {canary}; settled in {self.settle_s:.1f} s ({state}); "
            f"{self.seconds:.1f} s in all"
        )


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """Running and waiting requests and KV usage, from /metrics."""
    wanted = {
        "stepscope:num_requests_running": "running",
        "stepscope:num_requests_waiting": "waiting",
        "stepscope:kv_cache_usage_perc": "kv_usage",
        "stepscope:num_preemptions_total": "preemptions",
    }
    r = await client.get("/metrics", timeout=10)
    r.raise_for_status()
    values = {}
    for line in r.text.splitlines():
        name, _, rest = line.partition("{")
        if name in wanted:
            values[wanted[name]] = float(rest.rsplit(" ", 1)[1])
    return values


async def canary_tokens(client: httpx.AsyncClient, model: str) -> list[str]:
    body = {"model": model, "prompt": CANARY_PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip
    r = await client.post("/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["tokens"]


async def disconnect_after(
    client: httpx.AsyncClient, model: str, prompt: list[int], chunks: int
) -> bool:
    """A stream the client closes after `chunks` chunks; True if it got that far."""
    body = {"model": model, "prompt": prompt, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    seen = 0
    async with client.stream("POST", "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return False
        async for line in r.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                seen += 1
                if seen >= chunks:
                    return True  # leaving the block closes the connection mid-stream
    return False


async def abort_after(
    client: httpx.AsyncClient, model: str, prompt: list[int], seconds: float
) -> bool:
    """A non-streaming request the client gives up on; True if it was still running then."""
    body = {"model": model, "prompt": prompt, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    try:
        await client.post("/v1/completions", json=body, timeout=seconds)
    except httpx.TimeoutException:
        return True
    return False


async def hostile(client: httpx.AsyncClient, model: str, body: dict) -> str | None:
    """Send one hostile body; the problem with the answer, or None if it was a proper 4xx."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    payload = json.dumps({"model": model, **body}, allow_nan=True)
    try:
        r = await client.post(
            path, content=payload, headers={"content-type": "application/json"}, timeout=30
        )
    except httpx.TimeoutException:
        return "no answer within 30 s"
    if not 400 <= r.status_code < 500:
        return f"HTTP {r.status_code}: {r.text[:120]}"
    try:
        error = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error)
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"HTTP {r.status_code} without OpenAI's error shape: {r.text[:120]}"
    return None


async def settle(client: httpx.AsyncClient, timeout: float) -> tuple[dict[str, float], float]:
    """Wait until nothing runs, waits or holds KV blocks; the last reading and the time taken."""
    start = time.monotonic()
    while True:
        state = await metrics(client)
        busy = any(v for k, v in state.items() if k != "preemptions")
        if not busy or time.monotonic() - start > timeout:
            return state, time.monotonic() - start
        await asyncio.sleep(0.2)


def round_prompts(rng: random.Random, count: int, max_len: int) -> list[list[int]]:
    # Token ids from the middle of the vocabulary's common range, lengths from 8 to max_len.
    return [[rng.randrange(100, 20_000) for _ in range(rng.randint(8, max_len))]
            for _ in range(count)]  # fmt: skip


async def soak_round(
    client: httpx.AsyncClient,
    streams: CompletionStreams,
    model: str,
    index: int,
    args: argparse.Namespace,
    reference: list[str] | None,
) -> tuple[RoundReport, list[str]]:
    rep = RoundReport(index)
    rng = random.Random(args.seed + index)
    start = time.monotonic()
    prompts = round_prompts(rng, args.streams, args.max_prompt)
    cut = round_prompts(rng, args.disconnects + args.aborts, args.max_prompt)
    outputs = [rng.randint(8, args.max_output) for _ in prompts]
    # Everything at once: streams, disconnects and aborts compete for the same small pool.
    stream_calls = [
        stream_completion(streams, model, i, p, n)
        for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))
    ]
    cuts = [disconnect_after(client, model, p, 3) for p in cut[: args.disconnects]]
    aborts = [abort_after(client, model, p, args.abort_after) for p in cut[args.disconnects :]]
    preemptions_before = (await metrics(client))["preemptions"]
    # The canary runs amid the load too: preempted or not, its greedy tokens must not change.
    loaded_canary, *results = await asyncio.gather(
        canary_tokens(client, model), *stream_calls, *cuts, *aborts
    )
    stream_results = results[: len(stream_calls)]
    rep.streams_sent = len(stream_calls)
    for r in stream_results:  # nothing lost: each stream got every token it asked for
        if r.success and r.output_tokens != outputs[r.index]:
            r.success, r.error = False, f"{r.output_tokens} of {outputs[r.index]} tokens"
    rep.streams_ok = sum(r.success for r in stream_results)
    rep.disconnects = sum(results[len(stream_calls) : len(stream_calls) + len(cuts)])
    rep.aborts = sum(results[len(stream_calls) + len(cuts) :])
    for r in stream_results:
        if not r.success:
            rep.problems.append(f"stream {r.index}: {r.error}")
    for name, body in HOSTILE_BODIES:
        problem = await hostile(client, model, body)
        rep.hostile_sent += 1
        if problem is None:
            rep.hostile_4xx += 1
        else:
            rep.problems.append(f"hostile body '{name}': {problem}")
    tokens = await canary_tokens(client, model)
    if reference is not None:
        rep.canary_same = tokens == reference and loaded_canary == reference
        for when, got in (("under load", loaded_canary), ("after the round", tokens)):
            if got != reference:
                rep.problems.append(f"canary changed {when}: {got[:6]}... != {reference[:6]}...")
    rep.settled, rep.settle_s = await settle(client, SETTLE_TIMEOUT_S)
    rep.preemptions = int(rep.settled.pop("preemptions") - preemptions_before)
    if any(rep.settled.values()):
        rep.problems.append(f"not settled after {SETTLE_TIMEOUT_S:.0f} s: {rep.settled}")
    rep.seconds = time.monotonic() - start
    return rep, tokens


async def soak_async(args: argparse.Namespace) -> list[RoundReport]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with (
        httpx.AsyncClient(
            base_url=args.url.rstrip("/"), headers=headers, timeout=300, limits=limits
        ) as client,
        CompletionStreams(args.url, headers) as streams,
    ):
        model = args.model or await served_model(client)
        reference = await canary_tokens(client, model)  # on the quiet server, before any load
        reports = []
        for index in range(1, args.rounds + 1):
            rep, _ = await soak_round(client, streams, model, index, args, reference)
            print(rep.line(), flush=True)
            for problem in rep.problems[:10]:
                print(f"  problem: {problem}", flush=True)
            reports.append(rep)
        return reports


def check_args(args: argparse.Namespace) -> None:
    for name in ("rounds", "streams", "max_prompt", "max_output"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.disconnects < 0 or args.aborts < 0:
        raise ValueError("--disconnects and --aborts must not be negative")
    if args.max_prompt < 8:
        raise ValueError("--max-prompt must be at least 8")


def bench_soak(args: argparse.Namespace) -> bool:
    """Run the soak; True if every round held."""
    check_args(args)
    print(
        f"soak: {args.rounds} rounds against {args.url}: {args.streams} streams, "
        f"{args.disconnects} disconnects, {args.aborts} aborts, {len(HOSTILE_BODIES)} hostile "
        "bodies and a greedy canary per round",
        flush=True,
    )
    reports = asyncio.run(soak_async(args))
    held = all(r.held for r in reports)
    if held:
        print(
            f"soak held: {len(reports)} rounds, nothing lost "
            f"({sum(r.streams_ok for r in reports)} streams finished), no 5xx, no hang, "
            "canary unchanged, the server back to zero after every round",
            flush=True,
        )
    else:
        bad = [r.index for r in reports if not r.held]
        print(f"soak FAILED in rounds {bad}", flush=True)
    return held
