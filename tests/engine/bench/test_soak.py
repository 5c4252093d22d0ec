"""The soak that once wedged the server: a 96-block tiny-llama server under solo and concurrent
greedy streams, disconnects and hostile bodies must answer everything and come back to zero.
Then `stepscope bench soak` against the same server: rounds of all of it at once."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server_utils import CLI, Server

pytestmark = pytest.mark.slow  # minutes of streams against a small-pool server

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def small_pool_server():
    # The repro's server: 96 blocks of 16 hold 1,536 tokens (tiny-llama has 4,096 positions).
    s = Server("--model", MODEL, "--num-kv-blocks", "96", "--block-size", "16",
               "--max-num-seqs", "64")  # fmt: skip
    yield s
    s.stop()


async def stream_one(client, url, i, max_tokens=48, cut_after=None):
    prompt = f"Request {i}: " + "alpha beta gamma " * (5 + i % 20)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    pieces = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            return ("status", r.status_code)
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    return ("error-event", event["error"])
                pieces.append(event["choices"][0]["text"])
                if cut_after and len(pieces) >= cut_after:
                    return ("cut", len(pieces))
    return ("ok", "".join(pieces))


HOSTILE = [
    {"prompt": "x", "max_tokens": 10**9},
    {"prompt": "x" * 200000, "max_tokens": 5},
    {"prompt": [[-5, 3]], "max_tokens": 5},
    {"prompt": "x", "n": 10**6},
    {"prompt": "x", "logprobs": 10**6},
    {"prompt": "\ud800 broken surrogate"},
    {"prompt": "x", "temperature": float("nan")},
    {"prompt": "x", "logit_bias": {"99999999": 5}},
]
# Bodies that are fine, without max_tokens: the kind that once decoded past the pool and wedged.
ACCEPTED = [
    {"prompt": "x", "stop": ["a"] * 10000, "max_tokens": 8},
    {"prompt": "x", "seed": -1},
    {"prompt": "x", "temperature": 0.7, "max_tokens": None},
    {"prompt": "x", "logit_bias": {"5": 3}, "max_tokens": None},
]


def test_the_soak_sequence_leaves_the_server_whole(small_pool_server) -> None:
    url = small_pool_server.url

    async def run() -> None:
        async with httpx.AsyncClient() as c:
            solo = [await stream_one(c, url, i) for i in range(4)]
            together = await asyncio.gather(*(stream_one(c, url, i) for i in range(64)))
            assert [r[0] for r in together] == ["ok"] * 64
            assert together[:4] == solo  # greedy: the same text alone and among 64
            cut = await asyncio.gather(
                *(stream_one(c, url, 100 + i, max_tokens=200, cut_after=3) for i in range(16))
            )
            assert [r[0] for r in cut] == ["cut"] * 16
            for body in HOSTILE + ACCEPTED:
                r = await c.post(
                    url + "/v1/completions",
                    content=json.dumps({"model": MODEL, **body}, allow_nan=True),
                    headers={"content-type": "application/json"},
                    timeout=120,
                )
                expected = 400 if body in HOSTILE else 200
                assert r.status_code == expected, (body.keys(), r.text[:200])
                if expected == 400:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            # Without max_tokens a request runs to the context, which now fits in the pool.
            assert (await c.get(url + "/v1/models")).json()["data"][0]["max_model_len"] == 1536

    asyncio.run(run())
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert small_pool_server.metric(f"stepscope:{name}") == 0, name
    assert httpx.get(f"{url}/health").status_code == 200


def test_bench_soak_holds_for_two_rounds(small_pool_server, process_tree) -> None:
    cmd = [*CLI, "bench", "soak",
           "--url", small_pool_server.url, "--rounds", "2"]  # fmt: skip
    out = process_tree.run(cmd, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "soak held: 2 rounds" in out.stdout
    rounds = [line for line in out.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all("64/64 streams finished" in r for r in rounds)
    assert all("17/17 hostile bodies" in r and "canary unchanged" in r for r in rounds)
