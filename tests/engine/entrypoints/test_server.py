"""A real `stepscope serve` process on loopback, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import httpx
import openai
import psutil
import pytest

from tests.server_utils import API_KEY as KEY
from tests.server_utils import SERVED_MODEL as MODEL
from tests.server_utils import Server

# `server`: the shared tiny-llama server of tests/engine/conftest.py.


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def greedy(**kw) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": 8, **kw}


def test_models_lists_the_served_model(client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    # tiny-llama's checkpoint is float32, so dtype="auto" (serve's default) keeps float32.
    assert (models[0].dtype, models[0].dtype_reason) == (
        "float32",
        "auto: the checkpoint is float32",
    )
    # The budget the server runs (the server tier on a CPU; bench serve compares offline with it).
    assert (models[0].max_num_batched_tokens, models[0].max_num_seqs) == (512, 64)


def test_the_api_server_yields_the_cpu_to_the_engine(server) -> None:
    """`--api-server-niceness 10`: the API server lowers its priority once the engine runs, and
    the engine core, started before, keeps the priority it was started with."""
    headers = {"Authorization": f"Bearer {KEY}"}
    procs = httpx.get(f"{server.url}/processes", headers=headers, timeout=10).json()["data"]
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    by_role = {p["role"]: os.getpriority(os.PRIO_PROCESS, p["pid"]) for p in procs}
    assert by_role["api"] == min(ours + 10, 19)
    assert by_role["engine_core"] == ours


def test_reset_prefix_cache_empties_it_for_a_replay(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "the same words again " * 8, "max_tokens": 1}
    hits = []
    for reset in (False, True):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
        if reset:
            r = httpx.post(f"{server.url}/reset_prefix_cache", headers=headers, timeout=60)
            assert r.status_code == 200 and r.json() == {"reset": True}
        before = server.metric("stepscope:prefix_cache_hits_total")
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
        hits.append(server.metric("stepscope:prefix_cache_hits_total") - before)
    assert hits[0] > 0 and hits[1] == 0


def test_completion_returns_text_usage_and_finish_reason(client) -> None:
    r = client.completions.create(prompt="Hello, my name is", **greedy())
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.created > 0
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_completion_uses_the_chat_template(client) -> None:
    r = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **greedy())
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens > 5  # system prompt + template tokens around "Hi"


def test_a_list_of_prompts_gives_one_choice_each_and_token_ids_work(client) -> None:
    r = client.completions.create(prompt=["one", "two", "three"], **greedy())
    assert [c.index for c in r.choices] == [0, 1, 2]
    single = client.completions.create(prompt="two", **greedy())
    assert r.choices[1].text == single.choices[0].text
    ids = client.completions.create(prompt=[17, 42, 99], **greedy())
    assert ids.usage.prompt_tokens == 3


def test_n_2_returns_two_choices(client) -> None:
    r = client.completions.create(prompt="Once", n=2, **greedy(temperature=1.0, seed=3))
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16


def test_seed_makes_sampling_reproducible(client) -> None:
    kw = greedy(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    a = client.completions.create(prompt="The weather", **kw).choices[0].text
    b = client.completions.create(prompt="The weather", **kw).choices[0].text
    c = client.completions.create(prompt="The weather", **{**kw, "seed": 99}).choices[0].text
    assert a == b and a != c


def test_logprobs_in_completions_and_chat(client) -> None:
    r = client.completions.create(prompt="Hello", logprobs=3, **greedy(max_tokens=4))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert all(len(top) == 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=2,
        **greedy(max_tokens=4),
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_stop_strings_streamed_and_not(client) -> None:
    full = client.completions.create(prompt="Once upon a time", **greedy(max_tokens=16))
    text = full.choices[0].text
    stop = text[len(text) // 2 :][:3]
    cut = text.index(stop)
    r = client.completions.create(prompt="Once upon a time", stop=[stop], **greedy(max_tokens=16))
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        prompt="Once upon a time", stop=stop, stream=True, **greedy(max_tokens=16)
    )
    pieces = list(chunks)
    streamed = "".join(p.choices[0].text for p in pieces if p.choices)
    assert streamed == text[:cut] and pieces[-1].choices[0].finish_reason == "stop"


def test_streaming_chat_with_usage_matches_non_streaming(client) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(messages=messages, **greedy(max_tokens=12))
    stream = client.chat.completions.create(
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **greedy(max_tokens=12),
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"


def test_async_client_streams(server) -> None:
    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        stream = await client.completions.create(prompt="Hello", stream=True, **greedy())
        return "".join([c.choices[0].text async for c in stream])

    sync = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    assert asyncio.run(run()) == sync.completions.create(prompt="Hello", **greedy()).choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "error", "param", "message"),
    [
        ({"max_tokens": -1}, openai.BadRequestError, "max_tokens", "at least 1, got -1"),
        ({"temperature": -0.5}, openai.BadRequestError, "temperature", ">= 0, got -0.5"),
        ({"n": 1000}, openai.BadRequestError, "n", "between 1 and 16, got 1000"),
        ({"prompt": "word " * 600}, openai.BadRequestError, "prompt", "context is 512 tokens"),
        ({"presence_penalty": 50}, openai.BadRequestError, "presence_penalty", "[-2, 2], got 50"),
        ({"presence_penalty": -2.5}, openai.BadRequestError, "presence_penalty", "got -2.5"),
        ({"frequency_penalty": 2.01}, openai.BadRequestError, "frequency_penalty", "got 2.01"),
        (
            {"extra_body": {"repetition_penalty": 0}},
            openai.BadRequestError,
            "repetition_penalty",
            "must be > 0",
        ),
        ({"stop": ["word " * 600]}, openai.BadRequestError, "stop", "context of 512 tokens"),
        ({"model": "gpt-4"}, openai.NotFoundError, "model", "does not exist"),
    ],
)
def test_bad_requests_raise_the_matching_openai_errors(
    client, server, kwargs, error, param, message
) -> None:
    with pytest.raises(error) as info:
        client.completions.create(**{"prompt": "Hi", **greedy(), **kwargs})
    assert info.value.status_code == (404 if error is openai.NotFoundError else 400)
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == param and message in body["message"]
    # The refusal happened at the edge: the engine holds nothing and still serves.
    assert server.metric("stepscope:num_requests_waiting") == 0
    assert client.completions.create(prompt="Hi", **greedy()).usage.completion_tokens == 8


def test_penalties_in_range_are_accepted(client) -> None:
    r = client.completions.create(
        prompt="Hi", presence_penalty=-2, frequency_penalty=2, **greedy(max_tokens=2)
    )
    assert r.usage.completion_tokens == 2


def test_malformed_json_is_a_400_in_openai_shape(server) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": "\ud800 broken surrogate"}, "prompt", "lone UTF-16 surrogate"),
        ({"prompt": "x", "stop": ["ok", "\udfff"]}, "stop.1", "lone UTF-16 surrogate"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature", "finite number"),
        ({"prompt": "x", "top_p": float("inf")}, "top_p", "finite number"),
        ({"prompt": "x", "logit_bias": {"99999999": 5}}, "logit_bias", "outside the vocabulary"),
        ({"prompt": "x", "logit_bias": {"7": 500}}, "logit_bias", "logit_bias values must be in"),
        ({"prompt": "x", "logit_bias": {"seven": 1}}, "logit_bias", "must be token ids"),
        ({"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids", "outside the vocabulary"),
        ({"prompt": "x", "seed": 10**30}, "seed", "64-bit integer"),
        ({"prompt": "x", "top_k": 10**30}, "top_k", "64-bit integer"),
        ({"prompt": "x", "presence_penalty": float("nan")}, "presence_penalty", "finite number"),
        ({"prompt": "x", "max_tokens": 10**9}, "max_tokens", "ask for at most"),
    ],
)
def test_hostile_bodies_get_a_400_in_openai_shape(server, body, param, message) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        # allow_nan: NaN and Infinity as Python's json writes them, which many clients send.
        content=json.dumps({"model": MODEL, "max_tokens": 4, **body}, allow_nan=True),
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and message in error["message"]
    if param is not None:
        assert error["param"] == param
    assert server.metric("stepscope:num_requests_waiting") == 0


def test_logit_bias_steers_greedy_sampling(client) -> None:
    plain = client.completions.create(prompt="Hello", **greedy(max_tokens=4))
    forced = client.completions.create(
        prompt="Hello", logit_bias={"42": 100}, logprobs=1, **greedy(max_tokens=4)
    )
    assert forced.choices[0].logprobs.tokens == [":"] * 4  # token 42 of the SmolLM2 vocabulary
    assert forced.choices[0].text != plain.choices[0].text
    # Logprobs are the model's own, before the bias.
    assert all(lp < 0 for lp in forced.choices[0].logprobs.token_logprobs)


def test_echo_returns_the_prompt_with_its_logprobs_and_max_tokens_0_only_scores(
    server, client
) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The cat sat on the"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 512
    tokens = ids["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()
    assert text == {"prompt": "The cat sat on the"}
    scored = client.completions.create(
        prompt=[tokens, tokens[:3]], echo=True, logprobs=2, **greedy(max_tokens=0)
    )
    for choice, prompt in zip(scored.choices, [tokens, tokens[:3]], strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
        # each prompt token's logprob is at most its position's best
        assert all(v <= max(t.values()) + 1e-6 for v, t in zip(
            lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True))  # fmt: skip
    assert scored.choices[0].text == "The cat sat on the"
    # A prompt's prefix scores the same alone (within float noise of a different batch).
    long, short = (c.logprobs.token_logprobs for c in scored.choices)
    assert short[1:] == pytest.approx(long[1:3], abs=1e-4)
    assert scored.usage.completion_tokens == 0
    # With max_tokens 1 the completion follows the prompt, as lm-evaluation-harness reads it.
    one = client.completions.create(prompt=tokens, echo=True, logprobs=1, **greedy(max_tokens=1))
    plain = client.completions.create(prompt=tokens, logprobs=1, **greedy(max_tokens=1))
    assert one.choices[0].text == "The cat sat on the" + plain.choices[0].text
    assert len(one.choices[0].logprobs.tokens) == len(tokens) + 1
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(prompt="x", **greedy(max_tokens=0))  # without echo


def test_tokenizer_info_names_the_special_tokens(server) -> None:
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 512
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_wrong_or_missing_api_key_is_a_401(server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_health_version_and_metrics(server, client) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    client.completions.create(prompt="Hi", **greedy())
    text = httpx.get(f"{server.url}/metrics").text
    for name in [
        "stepscope:num_requests_running",
        "stepscope:num_requests_waiting",
        "stepscope:kv_cache_usage_perc",
        "stepscope:prefix_cache_queries_total",
        "stepscope:prefix_cache_hits_total",
        "stepscope:num_preemptions_total",
        "stepscope:prompt_tokens_total",
        "stepscope:generation_tokens_total",
        "stepscope:time_to_first_token_seconds_bucket",
        "stepscope:inter_token_latency_seconds_bucket",
        "stepscope:e2e_request_latency_seconds_bucket",
        "stepscope:request_queue_time_seconds_bucket",
        "stepscope:tokens_per_step_bucket",
    ]:
        assert name in text, name
    assert server.metric("stepscope:generation_tokens_total") >= 8


def test_64_concurrent_streams_equal_sequential_greedy_outputs(server) -> None:
    prompts = [f"Request number {i} says" for i in range(64)]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)

        async def one(p: str) -> str:
            stream = await client.completions.create(prompt=p, stream=True, **greedy())
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(p) for p in prompts))

    concurrent = asyncio.run(run())
    sync = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    sequential = [sync.completions.create(prompt=p, **greedy()).choices[0].text for p in prompts]
    assert concurrent == sequential


def test_client_disconnect_aborts_the_request(server) -> None:
    body = {"prompt": "Go on forever", "stream": True, **greedy(max_tokens=400, ignore_eos=True)}
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.metric("stepscope:num_requests_running") == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metric("stepscope:num_requests_running") != 0:
        time.sleep(0.2)
    assert server.metric("stepscope:num_requests_running") == 0
    assert server.metric("stepscope:kv_cache_usage_perc") == 0.0


def test_a_client_giving_up_on_a_non_streaming_request_aborts_it(server) -> None:
    body = {"prompt": "Go on forever", **greedy(max_tokens=480, ignore_eos=True)}
    before = server.metric("stepscope:generation_tokens_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{server.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=1.0,
        )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and server.metric("stepscope:num_requests_running") != 0:
        time.sleep(0.1)
    assert server.metric("stepscope:num_requests_running") == 0
    assert server.metric("stepscope:kv_cache_usage_perc") == 0.0
    # Aborted, not run to its end (480 tokens take this CPU several seconds).
    assert server.metric("stepscope:generation_tokens_total") - before < 480


@pytest.mark.slow
def test_openapi_describes_the_api_and_schemathesis_finds_no_5xx(process_tree) -> None:
    # Its own server, with a 64-token context: the OpenAPI description names the served model,
    # so the fuzzer's requests reach the engine, and each one it accepts stays short.
    server = Server("--model", MODEL, "--num-kv-blocks", "64", "--api-key", KEY,
                    "--max-model-len", "64", "--no-trace")  # fmt: skip
    try:
        spec = httpx.get(f"{server.url}/openapi.json").json()
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
        model = spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
        assert model["enum"] == [MODEL]
        result = process_tree.run(
            [
                os.path.join(os.path.dirname(sys.executable), "schemathesis"),
                "run",
                f"{server.url}/openapi.json",
                # Every check but two: no 5xx, and each answer (status, content type, body, a 405's
                # `Allow`) is the one the OpenAPI description promises, errors in OpenAI's shape.
                # Left out on purpose: the server refuses values JSON Schema allows (strings
                # with lone surrogates, a schema or regex the grammar compiler refuses). Unknown
                # fields are a 400 now (additionalProperties: false), but negative data is left
                # out as before.
                "--checks",
                "all",
                "--exclude-checks",
                "negative_data_rejection,positive_data_acceptance",
                # The coverage phase (its ~660 cases do not depend on this) takes most of the
                # time; the fuzzing phase adds at most this many random cases per operation.
                "--max-examples",
                "10",
                "--header",
                f"Authorization: Bearer {KEY}",
                "--request-timeout",
                "60",
                "--seed",
                "1",
                "--phases",
                "examples,coverage,fuzzing",
            ],
            timeout=600,
        )
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Missing test data" not in result.stdout  # it did reach the engine


@pytest.mark.slow
def test_waiting_queue_is_bounded_with_503_and_retry_after() -> None:
    s = Server("--model", MODEL, "--num-kv-blocks", "64", "--max-queued-requests", "2")
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 100, "ignore_eos": True}

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(
                    *(c.post(f"{s.url}/v1/completions", json=body) for _ in range(4))
                )

        codes = sorted(r.status_code for r in asyncio.run(run()))
        assert codes.count(200) >= 2 and 503 in codes
        rejected = next(r for r in asyncio.run(run()) if r.status_code == 503)
        assert rejected.headers["retry-after"] and rejected.json()["error"]["message"]
    finally:
        s.stop()


@pytest.mark.slow
def test_health_turns_503_when_the_engine_dies_and_ctrl_c_leaves_no_process() -> None:
    s = Server("--model", MODEL, "--num-kv-blocks", "64", "--tp", "2")
    try:
        children = [p.pid for p in psutil.Process(s.proc.pid).children(recursive=True)]
        core = next(
            p for p in psutil.Process(s.proc.pid).children() if "core_proc" in " ".join(p.cmdline())
        )
        os.kill(core.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        status = 200
        while time.monotonic() < deadline and status == 200:
            status = httpx.get(f"{s.url}/health").status_code
            time.sleep(0.1)
        assert status == 503
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 503
    finally:
        s.stop()
    assert s.proc.returncode is not None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in children):
        time.sleep(0.2)
    assert not [
        p
        for p in children
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
