"""`stepscope trace replay` (engine/bench/replay.py): a recorded run sent again to a fresh engine.

Replays of real tiny-llama runs, offline and served, read back from the new trace: the same
arrivals, lengths and prefix hits. Then the pieces on their own: `--set` parsing and its errors
(exit code 2, no traceback), the serve flags generated from a configuration, and the sampling
parameters a replayed request is sent with.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from stepscope.engine.bench.replay import (
    ReplayResult,
    completion_body,
    forced_params,
    format_result,
    parse_changes,
)
from stepscope.engine.config import EngineConfig
from stepscope.engine.engine_args import engine_config_from_args, engine_flags
from stepscope.engine.entrypoints.cli.main import build_parser, main
from stepscope.engine.entrypoints.protocol import CompletionRequest
from stepscope.engine.sampling_params import SamplingParams
from stepscope.traces import names as n
from stepscope.traces.backend.store import TraceStore
from stepscope.traces.backend.workload import RecordedRequest, load_workload
from tests.server_utils import API_KEY, Server

SHARED = "The quick brown fox jumps over the lazy dog. " * 6  # 60 tokens: three full blocks
ENGINE = {"num_kv_blocks": 64, "max_num_batched_tokens": 32, "max_num_seqs": 8}
PAUSE_S = 0.4  # between the two batches of the offline recording


def _requests(path: str) -> list[dict]:
    with TraceStore(path, read_only=True) as store:
        return store.query(
            "SELECT request_id, start_ns, queued_ns, input_tokens, output_tokens, cached_tokens, "
            "prompt_block_hashes FROM requests ORDER BY start_ns, queued_ns"
        )


def _offsets(rows: list[dict], column: str) -> list[float]:
    first = rows[0]["start_ns"]
    return [(r[column] - first) / 1e9 for r in rows]


def _shared_blocks(rows: list[dict]) -> list[list[int]]:
    """For each pair of requests, how many leading block hashes they share."""

    def shared(a: list[str], b: list[str]) -> int:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    return [
        [shared(a["prompt_block_hashes"], b["prompt_block_hashes"]) for b in rows] for a in rows
    ]


def assert_same_workload(recorded: list[dict], replayed: list[dict], arrival_tol_s: float) -> None:
    assert len(replayed) == len(recorded)
    for rec, new in zip(recorded, replayed, strict=True):
        assert new["input_tokens"] == rec["input_tokens"]
        assert new["output_tokens"] == rec["output_tokens"]
        # The same block size: every prefix hit again, to the token.
        assert new["cached_tokens"] == rec["cached_tokens"], (rec, new)
    for rec, new in zip(
        _offsets(recorded, "start_ns"), _offsets(replayed, "start_ns"), strict=True
    ):
        assert abs(new - rec) <= arrival_tol_s
    assert _shared_blocks(replayed) == _shared_blocks(recorded)


# ---- offline --------------------------------------------------------------------------------
def _record_offline(path: Path) -> None:
    """Two batches through `LLM`, the second after a pause: arrivals at two offsets, prefix hits
    within the first batch and on it from the second."""
    from stepscope.engine.entrypoints.llm import LLM

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(model="tiny-llama", trace_db=path, **ENGINE) as llm:
        llm.generate([SHARED + "Question 1", SHARED + "Question 2"], greedy, use_tqdm=False)
        time.sleep(PAUSE_S)
        llm.generate([SHARED + "Question 3", "Hi there"], greedy, use_tqdm=False)


def test_offline_replay_reproduces_arrivals_lengths_and_prefix_hits(tmp_path, capsys):
    recorded_path, new_path = tmp_path / "rec.duckdb", tmp_path / "new.duckdb"
    _record_offline(recorded_path)
    recorded = _requests(str(recorded_path))
    assert sum(r["cached_tokens"] > 0 for r in recorded) >= 2  # hits within and across batches
    assert _offsets(recorded, "start_ns")[2] >= PAUSE_S

    main(["trace", "replay", str(recorded_path), "--set", "max_num_seqs=4", "-o", str(new_path)])
    out = capsys.readouterr().out
    assert "replayed 4 requests" in out and str(new_path) in out

    replayed = _requests(str(new_path))
    assert [r["request_id"] for r in replayed] == [r["request_id"] for r in recorded]
    assert_same_workload(recorded, replayed, arrival_tol_s=0.05)
    # Each request entered the engine when its time came: after the pause for the second batch.
    for rec, new in zip(
        _offsets(recorded, "queued_ns"), _offsets(replayed, "queued_ns"), strict=True
    ):
        assert rec - 0.5 <= new <= rec + 2.0
    # The recorded configuration ran, with only the one option changed.
    before, after = load_workload(str(recorded_path)), load_workload(str(new_path))
    assert after.entry == n.ENTRY_OFFLINE
    assert after.engine_config["scheduler_config"]["max_num_seqs"] == 4
    for part in ("cache_config", "model_config"):
        assert {**after.engine_config[part], "dtype_reason": None} == {
            **before.engine_config[part],
            "dtype_reason": None,
        }
    assert after.engine_config["observability_config"]["trace_db"] == str(new_path)


# ---- served ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_served_replay_starts_a_server_and_reproduces_the_recorded_run(
    tmp_path, process_tree, capsys
):
    recorded_path, new_path = tmp_path / "rec.duckdb", tmp_path / "new.duckdb"
    shared = list(range(100, 148))  # three full blocks every prompt but the last shares
    prompts = [shared + [7, 8], shared + [9], shared + list(range(300, 320)), list(range(500, 520))]
    with process_tree.adopting():
        server = Server(
            "--model", "tiny-llama", "--trace-db", str(recorded_path),
            *engine_flags(ENGINE),
        )  # fmt: skip
    try:
        threads = []
        for i, prompt in enumerate(prompts):
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 3 + i,
                    "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            post = threading.Thread(
                target=httpx.post,
                args=(f"{server.url}/v1/completions",),
                kwargs={"json": body, "timeout": 120},  # fmt: skip
            )
            post.start()
            threads.append(post)
            time.sleep(0.5)
        for post in threads:
            post.join()
    finally:
        server.stop()
    recorded = _requests(str(recorded_path))
    assert [r["cached_tokens"] for r in recorded] == [0, 48, 48, 0]

    with process_tree.adopting():
        main(["trace", "replay", str(recorded_path), "-o", str(new_path)])
    out = capsys.readouterr().out
    assert "replayed 4 requests (served" in out and str(new_path) in out
    assert load_workload(str(new_path)).entry == n.ENTRY_SERVE
    assert_same_workload(recorded, _requests(str(new_path)), arrival_tol_s=0.4)
    assert process_tree.wait_gone(timeout=30) == []  # the replay's server stopped cleanly


def test_url_replay_sends_the_workload_to_a_running_server(server, tmp_path, capsys):
    # Three requests a quarter of a second apart; the second with its prompt ids recorded
    # (--trace-content), the third sharing the first one's first block.
    sampling = msgspec.json.encode(msgspec.structs.asdict(SamplingParams(temperature=0.5, seed=3)))
    requests = [
        {n.GEN_AI_USAGE_INPUT_TOKENS: 40, n.GEN_AI_USAGE_OUTPUT_TOKENS: 3,
         n.PROMPT_BLOCK_HASHES: ["aa", "bb"]},
        {n.GEN_AI_USAGE_INPUT_TOKENS: 5, n.GEN_AI_USAGE_OUTPUT_TOKENS: 4,
         n.PROMPT_BLOCK_HASHES: [], n.PROMPT_TOKEN_IDS: [11, 12, 13, 14, 15]},
        {n.GEN_AI_USAGE_INPUT_TOKENS: 20, n.GEN_AI_USAGE_OUTPUT_TOKENS: 2,
         n.PROMPT_BLOCK_HASHES: ["aa"]},
    ]  # fmt: skip
    for attributes in requests:
        attributes[n.SAMPLING_PARAMS] = sampling.decode()
    trace = _trace_with_run(tmp_path / "run.duckdb", requests, entry=n.ENTRY_SERVE)
    main(["trace", "replay", trace, "--url", server.url, "--api-key", API_KEY])  # exit 0
    out = capsys.readouterr().out
    assert "replayed 3 requests (served" in out and "the server's own trace file" in out


# ---- the pieces -----------------------------------------------------------------------------
def _span(name: str, index: int, start_ns: int, attributes: dict) -> dict:
    return dict(
        trace_id=f"{index:032x}", span_id=f"{index:016x}", name=name, start_ns=start_ns,
        end_ns=start_ns + 10**8, duration_ns=10**8, attributes=attributes,
    )  # fmt: skip


def _trace_with_run(path: Path, requests: tuple[dict, ...] | list[dict] = (), entry=None) -> str:
    """A trace file holding a `stepscope.run` span, as `LLM` records it, and a request span
    with each of `requests`' attributes, a quarter of a second apart."""
    config = msgspec.json.encode(EngineConfig.create(model="tiny-llama")).decode()
    run = {n.ENGINE_CONFIG: config, n.ENTRY: entry or n.ENTRY_OFFLINE}
    spans = [_span(n.RUN, 1, 0, run)]
    for i, attributes in enumerate(requests):
        spans.append(
            _span(n.REQUEST, i + 2, 10**9 + i * 250_000_000, {n.REQUEST_ID: f"r{i}", **attributes})
        )
    store = TraceStore(path)
    store.insert_spans(spans)
    store.close()
    return str(path)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("max_num_seq=4", "unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'?"),
        ("max_num_seqs=four", "max_num_seqs takes int values, got 'four'"),
        ("enable_prefix_caching=maybe", "enable_prefix_caching takes true or false"),
        ("block_size=24", "block_size must be a multiple of 16, got 24"),
        ("max_num_seqs=0", "max_num_seqs must be positive, got 0"),
        ("dtype=float8", "dtype must be one of"),
        ("max_num_seqs", "--set takes KEY=VALUE"),
    ],
)
def test_bad_set_is_refused_by_name_with_exit_code_2(tmp_path, capsys, setting, message):
    trace = _trace_with_run(tmp_path / "run.duckdb")
    with pytest.raises(SystemExit) as exited:
        main(["trace", "replay", trace, "--set", setting, "-o", str(tmp_path / "new.duckdb")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "new.duckdb").exists()


def test_existing_output_and_url_with_settings_are_refused(tmp_path, capsys):
    trace = _trace_with_run(tmp_path / "run.duckdb")
    for argv in (
        ["-o", trace],
        ["--url", "http://127.0.0.1:9", "--set", "max_num_seqs=4"],
        [],
    ):
        with pytest.raises(SystemExit) as exited:
            main(["trace", "replay", trace, *argv])
        assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--url replays against a running server" in err
    assert "give -o" in err


def test_set_values_take_their_option_types():
    assert parse_changes(
        ["max_num_seqs=4", "enable_prefix_caching=off", "num_kv_blocks=none", "dtype=bfloat16"]
    ) == {"max_num_seqs": 4, "enable_prefix_caching": False, "num_kv_blocks": None,
          "dtype": "bfloat16"}  # fmt: skip


def test_serve_flags_from_a_config_ask_for_that_config():
    options = {
        "model": "tiny-llama", "num_kv_blocks": 64, "enable_prefix_caching": False,
        "quantization": None, "max_model_len": None, "executor": "uni", "trace_steps": "every:2",
        "async_scheduling": True, "max_num_batched_tokens": 48,
    }  # fmt: skip
    args = build_parser().parse_args(["serve", *engine_flags(options)])
    assert engine_config_from_args(args, offline=False) == EngineConfig.create(
        **options, offline=False
    )


def _recorded(sampling: dict, output_tokens: int = 5) -> RecordedRequest:
    return RecordedRequest(
        request_id="r", arrival_s=0.0, before_engine_s=0.0, after_engine_s=0.0, input_tokens=8,
        output_tokens=output_tokens, cached_tokens=0, block_hashes=(), prompt_token_ids=None,
        sampling=sampling, operation=n.OPERATION_CHAT, dp_rank=0, ttft_s=None, e2e_s=1.0,
    )  # fmt: skip


def test_replayed_params_keep_the_sampling_and_force_the_length():
    recorded = msgspec.structs.asdict(
        SamplingParams(
            n=3,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=11,
            max_tokens=100,
            min_tokens=2,
            stop=["\n"],
            stop_token_ids=[2],
            logit_bias={5: 1.5},
            presence_penalty=0.5,
            logprobs=2,
        )  # fmt: skip
    )
    params = forced_params(_recorded(msgspec.json.decode(msgspec.json.encode(recorded))))
    assert (params.n, params.max_tokens, params.min_tokens, params.ignore_eos) == (1, 5, 0, True)
    assert params.stop == [] and params.stop_token_ids == []
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 20, 11)
    assert params.logit_bias == {5: 1.5} and params.presence_penalty == 0.5
    assert params.logprobs == 2
    # Sent to a server, the body asks for the same parameters.
    body = CompletionRequest(model="m", prompt=[1, 2], max_tokens=5, **completion_body(params))
    assert body.to_sampling_params() == params


def test_summary_says_what_was_replayed_and_where_it_is_recorded():
    served = ReplayResult(n.ENTRY_SERVE, {}, 3, 1, ["HTTP 503: busy"], 34280.12, None)
    assert format_result(served).splitlines() == [
        "replayed 3 requests (served; changed: nothing) in 34280 s",
        "left out 1 recorded requests that generated no token",
        "1 failed; the first: HTTP 503: busy",
        "new trace: the server's own trace file (its --trace-db)",
    ]
    offline = ReplayResult(n.ENTRY_OFFLINE, {"max_num_seqs": 4}, 2, 0, [], 0.01234, "new.duckdb")
    assert format_result(offline) == (
        "replayed 2 requests (offline, through LLM; changed: max_num_seqs=4) in 12.34 ms\n"
        "new trace: new.duckdb"
    )
