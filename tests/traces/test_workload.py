"""The workload a trace recorded (traces/backend/workload.py): read back from the session's real
TP=2 run, and synthetic prompts built from hand-made workloads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stepscope.traces import names as n
from stepscope.traces.backend.compare import compare, recorded_table
from stepscope.traces.backend.source import open_trace
from stepscope.traces.backend.store import TraceStore
from stepscope.traces.backend.workload import (
    RecordedRequest,
    Workload,
    load_workload,
    run_starts,
    synthetic_prompts,
)
from stepscope.traces.spans import prompt_block_hashes
from tests.traced_runs import TP2_MAX_TOKENS, TP2_PROMPTS, TP2_TOKEN_PROMPTS


def _request(rid: str, input_tokens: int, hashes: tuple[str, ...], ids=None) -> RecordedRequest:
    """A hand-made request; its hash names become hex strings, as the trace holds them."""
    return RecordedRequest(
        request_id=rid, arrival_s=0.0, before_engine_s=0.0, after_engine_s=0.0,
        input_tokens=input_tokens, output_tokens=4, cached_tokens=0,
        block_hashes=tuple(h.encode().hex() for h in hashes),
        prompt_token_ids=ids, sampling={}, operation=n.OPERATION_TEXT_COMPLETION, dp_rank=0,
        ttft_s=None, e2e_s=1.0,
    )  # fmt: skip


def _workload(*requests: RecordedRequest, block_size: int = 16) -> Workload:
    return Workload(requests, {"cache_config": {"block_size": block_size}}, "offline", block_size)


def test_tp2_trace_gives_its_config_lengths_sampling_and_shared_prefixes(traced_tp2_run):
    w = load_workload(traced_tp2_run.path)
    assert w.entry == n.ENTRY_OFFLINE and w.block_size == 16
    assert w.engine_config["parallel_config"]["tensor_parallel_size"] == 2
    assert w.engine_config["cache_config"]["num_kv_blocks"] == 14
    assert w.engine_config["scheduler_config"]["max_num_batched_tokens"] == 64
    assert len(w.requests) == len(TP2_PROMPTS)
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)
    assert w.requests[0].arrival_s == 0.0
    by_id = {r.request_id: r for r in w.requests}
    for i, max_tokens in enumerate(TP2_MAX_TOKENS):  # LLM.generate numbers prompts 0, 1, ...
        r = by_id[str(i)]
        assert r.output_tokens == max_tokens
        assert r.sampling["max_tokens"] == max_tokens and r.sampling["temperature"] == 0.0
        assert len(r.block_hashes) == r.input_tokens // w.block_size
        assert r.prompt_token_ids is None  # recorded without --trace-content
        assert r.before_engine_s >= 0 and r.after_engine_s >= 0 and r.e2e_s > 0
    # The token-id prompts are known exactly: their hashes are those of their ids.
    ids = TP2_TOKEN_PROMPTS[0]
    assert by_id["8"].block_hashes == tuple(prompt_block_hashes(ids, 16))
    # The text prompts share their first blocks; every hit covers blocks an earlier one hashed.
    text = [by_id[str(i)] for i in range(8)]
    assert len({r.block_hashes[:3] for r in text}) == 1
    hit = [r for r in w.requests if r.cached_tokens]
    assert hit
    for r in hit:
        k = r.cached_tokens // w.block_size
        assert any(o.block_hashes[:k] == r.block_hashes[:k] for o in w.requests if o is not r)


def test_tp2_synthetic_prompts_share_exactly_the_recorded_blocks(traced_tp2_run):
    w = load_workload(traced_tp2_run.path)
    prompts = synthetic_prompts(w, vocab_size=32000)
    for r, p in zip(w.requests, prompts, strict=True):
        assert len(p) == r.input_tokens and all(1 <= t < 32000 for t in p)
        # The synthetic prompt hashes to the recorded hashes' sharing pattern.
        assert len(prompt_block_hashes(p, 16)) == len(r.block_hashes)
    for a, pa in zip(w.requests, prompts, strict=True):
        for b, pb in zip(w.requests, prompts, strict=True):
            pairs = zip(a.block_hashes, b.block_hashes, strict=False)
            common = min(len(a.block_hashes), len(b.block_hashes))
            shared = next((i for i, (x, y) in enumerate(pairs) if x != y), common)
            assert pa[: shared * 16] == pb[: shared * 16]
            if shared < common:
                assert pa[shared * 16 : (shared + 1) * 16] != pb[shared * 16 : (shared + 1) * 16]


def test_equal_hashes_give_equal_blocks_and_unequal_ones_differ():
    w = _workload(
        _request("a", 40, ("h1", "h2")),
        _request("b", 40, ("h1", "h3")),
        _request("c", 32, ("h1", "h2")),
    )
    a, b, c = synthetic_prompts(w, vocab_size=1000)
    assert [len(a), len(b), len(c)] == [40, 40, 32]
    assert a[:16] == b[:16] == c[:16]
    assert a[16:32] == c[16:32] and a[16:32] != b[16:32]
    assert a[32:] != b[32:]  # the partial last block is each request's own
    assert all(1 <= t < 1000 for t in a + b + c)


def test_blocks_without_a_hash_are_unique_per_request():
    a, b = synthetic_prompts(_workload(_request("a", 32, ()), _request("b", 32, ())), 1000)
    assert len(a) == len(b) == 32 and a[:16] != b[:16] and a[16:] != b[16:]


def test_recorded_ids_are_used_as_they_are():
    ids = (5, 6, 7, 8, 9)
    (p,) = synthetic_prompts(_workload(_request("a", 5, (), ids)), vocab_size=10)
    assert p == list(ids)


def test_same_workload_gives_the_same_prompts():
    w = _workload(_request("a", 50, ("aa", "bb", "cc")))
    assert synthetic_prompts(w, 500) == synthetic_prompts(w, 500)


def test_trace_without_a_run_span_is_refused_by_name(tmp_path):
    path = tmp_path / "old.duckdb"
    store = TraceStore(path)
    span = {"trace_id": "1" * 32, "span_id": "2" * 16, "name": n.REQUEST, "start_ns": 0,
            "end_ns": 1, "duration_ns": 1, "attributes": {n.REQUEST_ID: "0"}}  # fmt: skip
    store.insert_spans([span])
    store.close()
    with pytest.raises(ValueError, match="recorded before replay existed"):
        load_workload(str(path))


# ---- one run per trace ---------------------------------------------------------------------------
def appended_again(trace: str, path: Path, later_s: float = 60.0) -> str:
    """A copy of `trace` with every one of its spans appended again `later_s` later, under new
    ids and from another process: what a second run given the same trace file leaves."""
    shutil.copy(trace, path)
    shift = round(later_s * 1e9)
    store = TraceStore(path)
    spans = store.df("SELECT * FROM spans").to_dict("records")
    again = []
    for span in spans:
        events = json.loads(span["events"])
        for event in events:
            event["time_ns"] += shift
        resource = json.loads(span["resource"])
        resource[n.PROCESS_PID] = resource.get(n.PROCESS_PID, 0) + 1
        parent = span["parent_span_id"]
        ids = {"trace_id": _other(span["trace_id"]), "span_id": _other(span["span_id"])}
        again.append({**span, **ids,
                      "parent_span_id": _other(parent) if isinstance(parent, str) else None,
                      "start_ns": span["start_ns"] + shift, "end_ns": span["end_ns"] + shift,
                      "events": events, "resource": resource})  # fmt: skip
    store.insert_spans(again)
    store.close()
    return str(path)


def _other(hex_id: str) -> str:
    """Another id: the first hex digit moved by 8."""
    return f"{(int(hex_id[0], 16) + 8) % 16:x}" + hex_id[1:]


def test_a_trace_holding_two_runs_is_refused_by_every_reader(traced_offline_run, tmp_path):
    path = appended_again(traced_offline_run, tmp_path / "two.duckdb")
    with open_trace(traced_offline_run) as one, open_trace(path) as two:
        assert len(run_starts(one)) == 1
        first, second = run_starts(two)
        assert second - first == 60_000_000_000
        for read in (load_workload, recorded_table, lambda s: compare(one, s)):
            with pytest.raises(ValueError, match=r"holds 2 runs, started at .*its own file"):
                read(two)
    with pytest.raises(ValueError, match=f"{path} holds 2 runs"):
        load_workload(path)


def _span(name: str, start_s: float, pid: int, **attributes) -> dict:
    start = round(start_s * 1e9)
    return {"trace_id": f"{start:032x}", "span_id": f"{start:016x}", "name": name,
            "start_ns": start, "end_ns": start + 1, "attributes": attributes,
            "resource": {n.PROCESS_PID: pid}}  # fmt: skip


def _runs(tmp_path: Path, *spans: dict) -> int:
    path = tmp_path / "runs.duckdb"
    path.unlink(missing_ok=True)
    store = TraceStore(path)
    store.insert_spans(spans)
    count = len(run_starts(store))
    store.close()
    return count


def test_api_servers_of_one_deployment_are_one_run_a_process_starting_again_another(tmp_path):
    config = {n.ENGINE_CONFIG: '{"a": 1}', n.ENTRY: n.ENTRY_SERVE}
    api_0, api_1 = _span(n.RUN, 1, pid=10, **config), _span(n.RUN, 2, pid=11, **config)
    assert _runs(tmp_path, api_0, api_1) == 1
    assert _runs(tmp_path, api_0, api_1, _span(n.RUN, 9, pid=10, **config)) == 2
    other = _span(n.RUN, 9, pid=12, **{**config, n.ENGINE_CONFIG: '{"a": 2}'})
    assert _runs(tmp_path, api_0, api_1, other) == 2


def test_an_engine_core_starting_again_is_another_run(tmp_path):
    step = {n.STEP: 0}
    assert _runs(tmp_path, _span(n.ENGINE_STEP, 1, 5, **step), _span(n.ENGINE_STEP, 2, 6, **step,
                 **{n.DP_RANK: 1})) == 1  # fmt: skip
    assert (
        _runs(tmp_path, _span(n.ENGINE_STEP, 1, 5, **step), _span(n.ENGINE_STEP, 2, 6, **step)) == 2
    )
