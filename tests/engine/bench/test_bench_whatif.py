"""`stepscope bench whatif` (engine/bench/whatif*.py): the workloads it records, the settings it
changes them to, the error and ranking arithmetic on hand-made numbers, and (slow) the command
end to end on tiny-llama with a tiny workload: it records, predicts, replays and prints its
table (its structure, not its accuracy: that is the coordinator's run on a quiet machine)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from stepscope.engine.bench.whatif import plans
from stepscope.engine.bench.whatif_check import (
    METRICS,
    MetricCheck,
    case_table,
    cases_for,
    check_case,
    rank,
    ranking_line,
)
from stepscope.engine.bench.whatif_workloads import (
    BLOCK_SIZE,
    SYSTEM_TOKENS,
    Chat,
    ChatMix,
    bursty_chat,
    bursty_chat_plan,
    long_prompt_plan,
    small_pool_plan,
)
from stepscope.engine.entrypoints.cli.main import build_parser, main

VOCAB = 2000


def _blocks(chat: Chat) -> int:
    return -(-(len(chat.prompt) + chat.output_tokens) // BLOCK_SIZE)


def _pool_halved_holds_the_longest(plan) -> None:
    longest = max(_blocks(c) for c in plan.chats)
    assert plan.engine["num_kv_blocks"] // 2 >= longest + 1


# ---- the workloads -----------------------------------------------------------------------------
def test_bursty_chat_plan_sends_mixed_chats_in_bursts_sharing_a_system_prompt():
    plan = bursty_chat_plan(ChatMix(32, (16, 400), (16, 128), VOCAB, seed=3))
    assert len(plan.chats) == 32 and len(plan.bursts) >= 2
    assert all(5 <= len(b.chats) <= 16 for b in plan.bursts[:-1])
    assert plan.bursts[0].pause_s == 0 and all(0.3 <= b.pause_s <= 1.5 for b in plan.bursts[1:])
    prompts = [len(c.prompt) for c in plan.chats]
    outputs = [c.output_tokens for c in plan.chats]
    assert min(prompts) >= 16 and max(prompts) <= 400 and len(set(prompts)) > 20
    assert min(outputs) >= 16 and max(outputs) <= 128 and len(set(outputs)) > 10
    long_enough = [c.prompt for c in plan.chats if len(c.prompt) > SYSTEM_TOKENS + BLOCK_SIZE]
    assert len({tuple(p[:SYSTEM_TOKENS]) for p in long_enough}) == 1
    assert all(100 <= t < VOCAB for c in plan.chats for t in c.prompt)
    largest = max(sum(_blocks(c) for c in b.chats) for b in plan.bursts)
    assert plan.engine["num_kv_blocks"] >= largest  # the recorded pool holds any burst
    assert plan.engine["max_num_batched_tokens"] == 256 and plan.engine["max_num_seqs"] == 16
    _pool_halved_holds_the_longest(plan)


def test_long_prompt_plan_leads_the_middle_burst_with_the_long_prompt():
    plan = long_prompt_plan(ChatMix(12, (16, 128), (16, 64), VOCAB, seed=1), 1024)
    assert [len(b.chats) for b in plan.bursts] == [3, 7, 3]
    long = plan.bursts[1].chats[0]
    assert len(long.prompt) == 1024 and long.output_tokens == 16
    assert all(len(c.prompt) <= 128 for c in plan.chats if c is not long)
    assert plan.engine["num_kv_blocks"] > sum(_blocks(c) for c in plan.chats)
    _pool_halved_holds_the_longest(plan)
    with pytest.raises(ValueError, match="long_prompt"):
        long_prompt_plan(ChatMix(12, (16, 128), (16, 64), VOCAB), 100)


def test_small_pool_plan_holds_half_its_one_burst_and_still_the_longest_request_halved():
    plan = small_pool_plan(ChatMix(24, (32, 160), (64, 128), VOCAB, seed=2))
    assert [len(b.chats) for b in plan.bursts] == [24]
    grown = sum(_blocks(c) for c in plan.chats)
    assert plan.engine["num_kv_blocks"] < grown  # decoding must preempt
    _pool_halved_holds_the_longest(plan)
    with pytest.raises(ValueError, match="small pool outputs"):
        small_pool_plan(ChatMix(12, (32, 160), (64, 10), VOCAB))


def test_timing_workload_is_the_issue_mix():
    workload = bursty_chat(1000)
    assert len(workload.requests) == 1000
    assert min(r.input_tokens for r in workload.requests) >= 16
    assert max(r.input_tokens for r in workload.requests) <= 1000
    assert {r.output_tokens for r in workload.requests} <= set(range(16, 257))
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals)


def test_sizes_and_names_are_checked_before_anything_runs():
    parser = build_parser()

    def args(*extra: str) -> argparse.Namespace:
        return parser.parse_args(["bench", "whatif", "--model", "tiny-llama", *extra])

    assert [p.name for p in plans(args(), VOCAB)] == ["bursty_chat", "long_prompt", "small_pool"]
    assert [p.name for p in plans(args("--workloads", "small_pool"), VOCAB)] == ["small_pool"]
    for extra, message in [
        (("--replays", "1"), "--replays must be at least 2"),
        (("--workloads", "bursty"), "--workloads: choose from"),
        (("--chats", "0"), "--chats must be at least 1"),
        (("--max-output", "0"), "--max-output must be at least 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            plans(args(*extra), VOCAB)


# ---- the arithmetic ----------------------------------------------------------------------------
def test_cases_halve_and_double_the_recorded_budget_and_halve_the_pool():
    config = {"scheduler_config": {"max_num_batched_tokens": 256, "max_num_seqs": 16},
              "cache_config": {"num_kv_blocks": 100}}  # fmt: skip
    assert cases_for(config, None) == [
        ("budget /2", {"max_num_batched_tokens": 128}),
        ("budget x2", {"max_num_batched_tokens": 512}),
        ("max_num_seqs 8", {"max_num_seqs": 8}),
        ("pool /2", {"num_kv_blocks": 50}),
    ]
    from_memory = {**config, "cache_config": {"num_kv_blocks": None}}
    assert cases_for(from_memory, 3001)[3] == ("pool /2", {"num_kv_blocks": 1500})
    with pytest.raises(ValueError, match="no KV pool size"):
        cases_for(from_memory, None)


def test_error_is_relative_to_the_replays_mean_within_20_percent_or_20_ms():
    close = MetricCheck("ttft_p90_s", 1.1, (0.9, 1.1))
    assert close.replayed == pytest.approx(1.0)
    assert close.error == pytest.approx(0.1) and close.within
    assert close.spread == pytest.approx(0.2) and close.range == pytest.approx(0.2)
    # 43% off but 15 ms: a time within 20 ms is within.
    assert MetricCheck("ttft_p50_s", 0.050, (0.035, 0.035)).within
    assert not MetricCheck("ttft_p50_s", 0.060, (0.035, 0.035)).within  # 25 ms
    assert not MetricCheck("tpot_mean_s", 1.3, (1.0, 1.0)).within
    # Throughput has no floor: 25% off is out, whatever the units.
    slow = MetricCheck("throughput_tok_s", 100.0, (79.0, 81.0))
    assert slow.error == pytest.approx(0.25) and not slow.within
    missing = MetricCheck("ttft_p50_s", None, (0.5, 0.6))
    assert missing.error is None and missing.within is None
    row = close.row()
    assert row["replays"] == [0.9, 1.1] and row["within"] is True


def test_check_case_reads_every_number_of_both_tables():
    predicted = {"ttft_p50_s": 0.1, "ttft_p90_s": 0.3, "tpot_mean_s": 0.02,
                 "throughput_tok_s": 50.0}  # fmt: skip
    replays = [{**predicted, "ttft_p90_s": 0.25}, {**predicted, "ttft_p90_s": 0.35}]
    checks = check_case(predicted, replays)
    assert [c.key for c in checks] == list(METRICS)
    assert checks[1].replays == (0.25, 0.35) and checks[1].error == pytest.approx(0.0)
    table = case_table([("budget /2", {"max_num_batched_tokens": 128}, checks)])
    lines = table.splitlines()
    assert len(lines) == 1 + len(METRICS)
    assert "budget /2: max_num_batched_tokens=128" in lines[1]
    assert re.search(r"ttft p90\s+300 ms\s+300 ms\s+250 ms, 350 ms\s+\+0%\s+yes\s+33%", table)


def _p90(predicted: float, *replays: float) -> MetricCheck:
    return MetricCheck("ttft_p90_s", predicted, replays)


def test_ranking_by_p90_ttft_names_swaps_and_whether_the_replays_tell_them_apart():
    same = rank({"a": _p90(1.0, 1.1, 1.2), "b": _p90(2.0, 2.1, 2.0), "c": _p90(3.0, 2.9, 3.1)})
    assert same.same_order and same.swapped == [] and same.same_beyond_spread
    assert ranking_line(same).endswith("replayed the same order")
    # b and c swapped within the replays' own range; a and b swapped beyond it.
    mixed = rank({"a": _p90(1.0, 2.5, 2.6), "b": _p90(2.0, 1.0, 1.1), "c": _p90(3.0, 0.9, 1.1)})
    assert mixed.predicted == ["a", "b", "c"] and mixed.replayed == ["c", "b", "a"]
    swapped = {(a, b): apart for a, b, apart in mixed.swapped}
    assert swapped == {("a", "b"): True, ("a", "c"): True, ("b", "c"): False}
    assert not mixed.same_order and not mixed.same_beyond_spread
    line = ranking_line(mixed)
    assert "replayed c < b < a" in line
    assert "b / c swapped (within the replays' spread)" in line
    noisy = rank({"a": _p90(1.0, 1.3, 0.7), "b": _p90(2.0, 0.9, 1.0)})
    assert not noisy.same_order and noisy.same_beyond_spread
    # Each pair's own two replays agree closely, but the workload's replays differ by 10% on
    # average: 1.30 against 1.26 is within that, not told apart.
    pooled = rank({"a": _p90(1.0, 1.30, 1.31), "b": _p90(2.0, 1.26, 1.27),
                   "c": _p90(3.0, 3.0, 3.6), "d": _p90(4.0, 4.0, 4.7)})  # fmt: skip
    assert pooled.swapped == [("a", "b", False)] and pooled.same_beyond_spread


# ---- end to end --------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_whatif_records_predicts_replays_and_prints_its_table(tmp_path, capsys):
    out = tmp_path / "whatif.json"
    main(["bench", "whatif", "--model", "tiny-llama", "--workloads", "bursty_chat",
          "--chats", "2", "--max-prompt", "40", "--max-output", "4", "--grid-requests", "30",
          "--traces", str(tmp_path / "traces"), "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert text.startswith("machine: ")
    table = text[text.index("== bursty chat") :]
    assert re.search(r"setting\s+number\s+predicted\s+replayed\s+replays\s+error\s+within\s+"
                     r"spread", table)  # fmt: skip
    for label in ("budget /2: max_num_batched_tokens=", "budget x2: max_num_batched_tokens=",
                  "max_num_seqs 8: max_num_seqs=8", "pool /2: num_kv_blocks="):  # fmt: skip
        assert label in table
    for name in ("ttft p50", "ttft p90", "tpot mean", "throughput"):
        assert len(re.findall(rf"^\s.*{name}\s", table, re.M)) == 4
    assert "ranked by p90 TTFT: predicted " in table
    speeds = re.search(r"replays' steps against the cost model .*: budget /2 (\d+\.\d\d), "
                       r"(\d+\.\d\d); .*; mean (\d+\.\d\d)", table)  # fmt: skip
    assert speeds and all(float(v) > 0 for v in speeds.groups())
    assert re.search(r"\d+ of 16 numbers within the target", text)
    assert re.search(r"what-if grid: 9 settings over 30 bursty chat requests predicted in ", text)
    assert "e+" not in text and "e-0" not in text  # no scientific notation

    result = json.loads(out.read_text())
    (workload,) = result["workloads"]
    assert workload["name"] == "bursty_chat" and len(workload["cases"]) == 4
    recorded = workload["recorded_settings"]
    budgets = [c["settings"].get("max_num_batched_tokens") for c in workload["cases"][:2]]
    assert budgets == [recorded["max_num_batched_tokens"] // 2,
                       recorded["max_num_batched_tokens"] * 2]  # fmt: skip
    for case in workload["cases"]:
        assert len(case["replays"]) == 2 and set(case["numbers"]) == set(METRICS)
        for key, number in case["numbers"].items():
            assert number["replays"] == [r[key] for r in case["replays"]]
            assert number["predicted"] == case["predicted"][key]
            # Every replay ran the whole workload: its throughput is a number.
        assert all(r["throughput_tok_s"] for r in case["replays"])
        assert len(case["step_time_ratios"]) == 2 and all(r > 0 for r in case["step_time_ratios"])
    assert sorted(workload["ranking"]["predicted"]) == sorted(c["label"] for c in workload["cases"])
    assert result["grid"]["requests"] == 30 and result["grid"]["settings"] == 9
    # Traces kept: the recording and two replays per setting.
    assert len(list((tmp_path / "traces").glob("*.duckdb"))) == 1 + 4 * 2
