"""The tutorials' checked exercises (viz/exercises.py): for every exercise, a right answer holds
and a wrong one does not, each measured from a real run of the kind the lesson makes (the engine
on tiny-llama or a tiny random Gemma 3, the real scheduler, the lesson's own tables), and check()
without an answer only says how to call it. The runs that start processes are in the slow tier."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pandas as pd
import pytest

from stepscope.engine import LLM, SamplingParams
from stepscope.viz.exercises import _registered, check
from stepscope.viz.simulator import GROUP_A, WALKTHROUGH_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
GREEDY = dict(temperature=0, ignore_eos=True)


def holds(key: str, right: Any, wrong: Any, run: Any) -> None:
    assert check(key, answer=right, run=run) is True
    assert check(key, answer=wrong, run=run) is False


def test_every_exercise_is_tested_here() -> None:
    tested = set(re.findall(r'holds\(\s*"(\d\d\.\d)"', Path(__file__).read_text()))
    assert set(_registered()) == tested


def test_every_lesson_ends_its_exercises_with_a_check_of_each() -> None:
    for path in sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.ipynb")):
        lesson = path.name[:2]
        text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
        keys = sorted(k for k in _registered() if k.startswith(lesson + "."))
        assert keys, f"{path.name}: no checked exercise"
        missing = [k for k in keys if f'check("{k}"' not in text]
        assert not missing, f"{path.name} does not show how to check {missing}"


def test_check_without_an_answer_only_says_how(capsys: pytest.CaptureFixture[str]) -> None:
    assert check("03.1") is False
    assert 'check("03.1", answer=..., run=...)' in capsys.readouterr().out
    assert check("03") is False
    out = capsys.readouterr().out
    assert all(f'check("03.{k}"' in out for k in (1, 2, 3))
    with pytest.raises(ValueError, match="no exercise '99.1'"):
        check("99.1", answer=1, run=1)


def test_a_wrong_answer_is_told_what_the_run_shows(capsys: pytest.CaptureFixture[str]) -> None:
    settings = {**GROUP_A, **WALKTHROUGH_SETTINGS}
    check("03.1", answer=(30, 33), run=settings)
    out = capsys.readouterr().out
    assert out.startswith("not yet: 03.1: your answer (30, 33); your run shows (31, 33)")
    assert "first_chunk_blocks" in out
    with pytest.raises(ValueError, match="03.1: could not measure your run"):
        check("03.1", answer=(31, 33), run=pd.DataFrame())


# --- one in-process engine on tiny-llama, shared by the module's fast tests ------------------


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    db = tmp_path_factory.mktemp("exercises") / "uni.duckdb"
    with LLM(model="tiny-llama", max_num_batched_tokens=64, num_kv_blocks=64, trace_db=db) as llm:
        yield llm


def test_00_1_steps_and_first_step_tokens(llm: LLM) -> None:
    (out,) = llm.generate([list(range(1000, 1100))], SamplingParams(max_tokens=6, **GREEDY))
    # 100 prompt tokens under a 64-token budget: two chunks, then five decodes.
    holds("00.1", (7, 64), (6, 100), (llm, out.request_id))


def test_00_2_two_conversations_share_steps(llm: LLM) -> None:
    outs = llm.generate(
        [list(range(2000, 2010)), list(range(3000, 3012))],
        [SamplingParams(max_tokens=5, **GREEDY), SamplingParams(max_tokens=3, **GREEDY)],
    )
    holds("00.2", (5, 2), (8, 2), (llm, [o.request_id for o in outs]))


def _loop_by_hand(llm: LLM, prompts: dict[str, list[int]], max_tokens: int) -> pd.DataFrame:
    """Lesson 01's section 1: requests added to the engine core, stepped until done."""
    core = llm.engine_core
    for rid, ids in prompts.items():
        core.add_request(llm.processor.process(rid, ids, SamplingParams(max_tokens=max_tokens)))
    rows = []
    while core.has_unfinished_requests():
        outputs = core.step()
        rows.append({"sampled": [t for o in outputs.outputs for t in o.new_token_ids]})
    return pd.DataFrame(rows)


def test_01_1_prefill_steps_from_the_loop_table(llm: LLM) -> None:
    loop = _loop_by_hand(llm, {"by-hand": list(range(4000, 4150))}, max_tokens=6)
    holds("01.1", (3, 8), (2, 8), loop)  # 150 tokens: chunks of 64, 64, 22; then 5 decodes


def test_01_3_first_token_steps_of_two_requests(llm: LLM) -> None:
    prompts = {"long-1": list(range(5000, 5100)), "short-1": list(range(6000, 6020))}
    _loop_by_hand(llm, prompts, max_tokens=4)
    # Step 0: 64 of the long prompt; step 1: its last 36 and all 20 of the short one.
    holds("01.3", [1, 1], [1, 0], (llm, {"long-1": 100, "short-1": 20}))


def test_01_2_a_busy_step_with_five_chats(llm: LLM) -> None:
    core = llm.engine_core
    chat = SamplingParams(max_tokens=30, **GREEDY)
    for i in range(5):
        core.add_request(
            llm.processor.process(f"chat-{i}", list(range(7000 + 10 * i, 7010 + 10 * i)), chat)
        )
    core.step(), core.step()
    for rid, start, n in (("long-A", 8000, 200), ("long-B", 9000, 150)):
        core.add_request(llm.processor.process(rid, list(range(start, start + n)), chat))
    core.step()
    stats = core.scheduler.last_stats
    blocks = len(core.kv_cache_manager.block_ids("long-A"))
    snapshot = pd.DataFrame({"request": ["long-A"], "kv_blocks": [blocks]})
    core.abort_requests(list(core.scheduler.requests))
    holds("01.2", (5, 59, 4), (3, 61, 4), (stats, snapshot))  # 64 - 5 = 59 tokens: 4 blocks


# --- the real scheduler without a model (lessons 03, 06) ------------------------------------


def test_03_1_smaller_blocks() -> None:
    settings = {**GROUP_A, **WALKTHROUGH_SETTINGS, "block_size": 16, "free_blocks": 256}
    # 1984 tokens in blocks of 16: 124; 256 - 124 = 132 blocks left, more than 64 decodes need.
    holds("03.1", (124, 64), (31, 33), settings)


def test_03_2_enough_blocks_to_finish() -> None:
    # 62 blocks for the prompt, a 63rd for its first output token, and the decodes that cross a
    # block boundary in the same steps (the lesson's group A was preempted with 64).
    holds("03.2", 67, 64, {**GROUP_A, **WALKTHROUGH_SETTINGS})


def _notebook_cell(lesson: str, defines: str, scope: dict[str, Any]) -> dict[str, Any]:
    """Runs the lesson's own cell that defines `defines` (the learner's code), in `scope`."""
    path = next((ROOT / "tutorials").glob(f"{lesson}_*.ipynb"))
    cell = next(
        c.source
        for c in nbformat.read(path, as_version=4).cells
        if c.cell_type == "code" and f"def {defines}(" in c.source
    )
    exec(cell, scope)
    return scope


def test_06_1_chunks_beside_decodes() -> None:
    from stepscope.engine.core.kv_cache_manager import KVCacheManager
    from stepscope.engine.core.request import Request
    from stepscope.engine.core.scheduler import Scheduler
    from stepscope.engine.messages import ModelRunnerOutput

    imports = dict(
        SamplingParams=SamplingParams,
        KVCacheManager=KVCacheManager,
        Request=Request,
        Scheduler=Scheduler,
        ModelRunnerOutput=ModelRunnerOutput,
    )
    prefill_beside = _notebook_cell("06", "prefill_beside", imports)["prefill_beside"]
    # 80 - 20 = 60 tokens a step: 60, 60, 60, 12. More than 10 steps once 80 - d < 19.2: d = 61.
    holds("06.1", ([60, 60, 60, 12], 61), ([64, 64, 64], 61), prefill_beside)


def test_03_3_chunks_per_budget() -> None:
    def steps(chunks: list[int]) -> pd.DataFrame:
        return pd.DataFrame({"long prompt chunk": [0, *chunks, 0, 0]})

    run = {32: steps([24] * 12 + [12]), 128: steps([120, 120, 60])}
    holds("03.3", {32: [24] * 12 + [12], 128: [120, 120, 60]}, {32: [32] * 10, 128: [120] * 3}, run)


# --- the lessons' own tables, as their code builds them -------------------------------------


def test_02_3_chunks_per_budget() -> None:
    def chunked(budget: int) -> pd.DataFrame:  # four chats decode beside every chunk of 960
        left, prefill = 960, []
        while left:
            prefill.append(min(budget - 4, left))
            left -= prefill[-1]
        return pd.DataFrame({"decode": 4, "prefill": prefill + [0, 0]})

    run = {128: chunked(128), 256: chunked(256)}
    holds("02.3", {128: 8, 256: 4}, {128: 8, 256: 3}, run)  # 960 / 124 -> 8; 960 / 252 -> 4


def test_04_2_forward_share_of_execute() -> None:
    per_step = pd.DataFrame(
        {"execute_ns": [10_000, 12_000, 11_000], "forward0_ns": [6_000, 6_600, 6_000]}
    )
    holds("04.2", 0.5, 0.9, per_step)  # median share 0.545


def test_04_4_serving_processes_of_each_layout() -> None:
    def layout(roles: list[str | None]) -> pd.DataFrame:
        return pd.DataFrame({"role": roles, "pid": range(100, 100 + len(roles))})

    mp_tp2 = layout(
        ["api", "dp_coordinator", "engine_core", "engine_core"] + ["worker"] * 4 + [None]
    )
    uni = layout(["api", "dp_coordinator", "engine_core", "engine_core", None])
    holds(
        "04.4",
        {"mp, TP=2": 8, "uni": 4},
        {"mp, TP=2": 8, "uni": 6},
        {"mp, TP=2": mp_tp2, "uni": uni},
    )


def test_05_2_characters_held_back_for_two_stop_strings() -> None:
    from stepscope.engine.frontend.detokenizer import IncrementalDetokenizer
    from stepscope.engine.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("tiny-llama"))
    stops = ["END", "story"]
    detok = IncrementalDetokenizer(tok, tok.encode("Q:"), SamplingParams(stop=stops))
    (first,) = tok.encode("The", add_special_tokens=False)
    detok.update([first], finished=False)
    sent = detok.get_next_output_text(finished=False, delta=True)
    held = pd.DataFrame({"token": [tok.decode([first])], "delta sent": [sent]})
    # The longest stop string less one: "stor" could still grow into "story".
    holds("05.2", min(len("story") - 1, len(held.token[0])), 0, held)


def test_05_3_pieces_of_the_ttft_by_size() -> None:
    pieces = ["HTTP in", "1 · handler", "2 · API -> core", "3 · queue", "4-8 · prefill", "9", "SSE"]
    split = pd.DataFrame({"piece": pieces, "ms": [0.8, 4.1, 0.3, 0.2, 35.0, 0.4, 0.6]})
    holds("05.3", ["prefill", "handler", "body"], ["handler", "prefill", "body"], split)


def test_06_2_hit_tokens_are_whole_blocks() -> None:
    on = pd.DataFrame({"prefix_hit_tokens": [144], "new_request_tokens": [14], "decode": [8]})
    holds("06.2", (144, 14), (150, 8), on)  # 150 shared tokens: 9 blocks of 16


def test_06_3_blocks_beyond_cdiv() -> None:
    runs16 = pd.DataFrame(
        {"decode": [0, 16, 16, 16], "prefill": [64, 48, 48, 0], "new_blocks": [16, 2, 3, 16]}
    )
    # The 16 chats' crossing step: 16 tokens, cdiv(16, 32) = 1 block, 16 blocks taken.
    holds("06.3", 15, 0, (runs16, 32))


def test_07_1_cache_hits_on_readmission() -> None:
    columns = ["request", "preempted in step", "lost", "back in step", "hits", "recomputed"]
    hit = pd.DataFrame([("r3", 9, 33, 14, 32, 1)], columns=columns)
    miss = pd.DataFrame([("r3", 9, 33, 14, 0, 33)], columns=columns)
    none = pd.DataFrame([], columns=columns)
    run = {8: miss, 11: hit, 12: none}
    holds("07.1", {8: False, 11: True, 12: False}, {8: True, 11: True, 12: False}, run)


def test_07_2_prefill_steps_per_length() -> None:
    best = pd.DataFrame({"prefill steps": [1, 1, 1, 2, 4]}, index=[32, 64, 128, 256, 512])
    holds("07.2", [1, 1, 1, 2, 4], [1, 2, 4, 8, 16], best)


def test_07_3_gap_against_requests() -> None:
    run = {4: pd.Series([0.21, 0.25, 0.22]), 16: pd.Series([0.24, 0.26, 0.23])}
    holds("07.3", "same", "grows", run)


def test_07_4_requests_and_work_per_rank() -> None:
    per_rank = pd.DataFrame({"requests": [6, 6], "tokens scheduled": [700, 380]}, index=[0, 1])
    holds("07.4", ([6, 6], 0), ([12, 0], 0), per_rank)


def _explained(parts: dict[str, float], **rest: Any) -> dict[str, Any]:
    names = ("before_engine_s", "queue_s", "prefill_s", "decode_s", "preempted_s", "after_engine_s")
    return {"parts": {n: parts.get(n, 0.001) for n in names}, **rest}


def test_08_1_largest_parts_with_the_long_prompt_first() -> None:
    results = {
        "A": _explained({"queue_s": 0.9, "decode_s": 0.3}),
        "B": _explained({"queue_s": 0.9, "decode_s": 0.3}),
        "C": _explained({"queue_s": 0.9, "decode_s": 0.3}),
        "D": _explained({"queue_s": 0.8, "decode_s": 0.9}),
    }
    right = {"A": "queue_s", "B": "queue_s", "C": "queue_s", "D": "decode_s"}
    holds("08.1", right, {**right, "D": "queue_s"}, results)


def test_08_3_who_is_preempted_and_what_is_recomputed() -> None:
    pool = {
        "request 0": _explained({"decode_s": 1.0}, preemptions=0, recomputed_tokens=0),
        "request 1": _explained({"decode_s": 1.0}, preemptions=1, recomputed_tokens=31),
        "request 2": _explained({"preempted_s": 1.0}, preemptions=1, recomputed_tokens=48),
    }
    right = {"request 1": (1, 31), "request 2": (1, 48)}
    holds("08.3", right, {"request 2": (1, 48)}, pool)


def test_09_3_control_characters_the_raw_bound_admits() -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "rain": {"type": "boolean"},
            "mm": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["city", "rain", "mm"],
        "additionalProperties": False,
    }
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from stepscope.engine.sampling_params import json_schema_for_xgrammar

    # xgrammar 0.2.8's raw rule for a bounded string is [^"\\\r\n]: every other control
    # character leaks. The rewritten schema admits none of them.
    fixed = xgrammar.Grammar.from_json_schema(
        json_schema_for_xgrammar(json.dumps(schema)), any_whitespace=False
    )
    assert _is_grammar_accept_string(fixed, '{"city": "Ab", "rain": true, "mm": 0}')
    assert not _is_grammar_accept_string(fixed, '{"city": "A\x1e", "rain": true, "mm": 0}')
    leaked = set(range(0x20)) - {0x0A, 0x0D}
    holds("09.3", leaked, set(), schema)


# --- lesson 10: a tiny random Gemma 3 (five layers in a window of 24, one global) ------------


@pytest.fixture(scope="module")
def window_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[bool, int], Path]:
    """One 61-token prompt and 4 output tokens, hybrid on or off, by budget: each run's trace."""
    from tests.engine.models.checkpoints import build_checkpoint

    folder = tmp_path_factory.mktemp("window")
    model = build_checkpoint("gemma3", folder / "gemma3", seed=3)
    prompt = [(7 * j) % 4000 + 100 for j in range(61)]
    traces = {}
    for off, budget in ((False, 64), (True, 64), (False, 16)):
        db = folder / f"{'off' if off else 'on'}-{budget}.duckdb"
        with LLM(
            model=str(model),
            disable_hybrid_kv_cache_manager=off,
            num_kv_blocks=16 if off else 64,
            max_num_batched_tokens=budget,
            trace_db=db,
        ) as llm:
            llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
        traces[off, budget] = db
    return traces


def test_10_1_blocks_per_group_in_the_last_step(window_runs: dict) -> None:
    # The last decode computes token 64 from 63: the full group cdiv(64, 16) = 4 blocks, a
    # sliding one 4 less the whole blocks before 63 - 24 + 1 = 40, i.e. 2.
    holds("10.1", (4, 2), (4, 4), window_runs[False, 64])


def test_10_2_a_sliding_group_holds_a_chunk_and_its_window(window_runs: dict) -> None:
    # Chunks of 16: from 32 to 48 the group holds cdiv(48, 16) - (32 - 23) // 16 = 3 blocks, and
    # from 48 to 61 cdiv(61, 16) - (48 - 23) // 16 = 3; decoding, 2.
    holds("10.2", 3, 4, window_runs[False, 16])


def test_10_3_blocks_in_all_on_and_off(window_runs: dict) -> None:
    # On: 4 full-attention blocks and 2 in each of five sliding groups; off: one table of 4.
    holds("10.3", (14, 4), (4, 4), (window_runs[False, 64], window_runs[True, 64]))


# --- slow: engines in processes of their own, a server, whatif ------------------------------


@pytest.mark.slow
def test_02_1_04_1_and_04_3_tensor_parallel_processes(llm: LLM) -> None:
    import psutil

    from stepscope.viz.lessons import process_table

    # Before any other engine of this module starts processes: the tree below is this one's.
    with LLM(model="tiny-llama", executor="mp", tensor_parallel_size=2, num_kv_blocks=64) as tp2:
        holds("02.1", (4, True), (3, True), tp2)  # the kernel, the engine core, two workers
        holds("04.3", {1: 1, 2: 4}, {1: 1, 2: 3}, {1: llm, 2: tp2})
        # 04.1 reads a server's tree; this process's tree has the same serving kinds at TP = 2.
        kinds = sorted(process_table(psutil.Process(), "API server").kind)
        assert kinds.count("worker") == 2 and kinds.count("engine core") == 1
        holds("04.1", kinds, sorted(k for k in kinds if k != "worker"), psutil.Process().pid)


@pytest.fixture(scope="module")
def mp_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, dict[str, str]]]:
    """An open `executor="mp"` engine with async scheduling, its trace holding a 400-token
    prompt alone, then three plain requests beside a JSON one (A), then a choice (B) and A's
    schema again (C), as lesson 09 sends them."""
    from stepscope.engine.sampling_params import StructuredOutputsParams

    db = tmp_path_factory.mktemp("exercises-mp") / "mp.duckdb"
    schema = json.dumps({"type": "object", "properties": {"rain": {"type": "boolean"}}})

    def structured(**kind: Any) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(**kind)
        )

    plain = SamplingParams(max_tokens=12, **GREEDY)
    with LLM(
        model="tiny-llama",
        executor="mp",
        async_scheduling=True,
        max_num_batched_tokens=64,
        num_kv_blocks=128,
        trace_db=db,
    ) as llm:
        (long,) = llm.generate([list(range(1000, 1400))], SamplingParams(max_tokens=4, **GREEDY))
        first = llm.generate(
            ["Hello", "Once", "1 2 3", "JSON:"], [plain] * 3 + [structured(json=schema)]
        )
        second = llm.generate(
            ["One word:", "JSON:"], [structured(choice=["a", "b"]), structured(json=schema)]
        )
        ids = {"long": long.request_id, "A": first[3].request_id}
        ids |= {"B": second[0].request_id, "C": second[1].request_id}
        yield llm, ids


@pytest.mark.slow
def test_00_3_processes_and_boundaries_of_mp(mp_run: tuple[LLM, dict[str, str]]) -> None:
    llm, _ = mp_run
    holds("00.3", (3, 4), (1, 0), llm)  # this kernel, the engine core, a worker; four crossings


@pytest.mark.slow
def test_02_2_bytes_of_a_new_request(mp_run: tuple[LLM, dict[str, str]]) -> None:
    llm, ids = mp_run
    # 400 prompt ids at 3 bytes each in msgpack, and about 150 bytes of the rest; a 40-token
    # prompt would be 120 bytes of ids. (The run's largest SchedulerOutput carries bitmasks.)
    holds("02.2", 3 * 400 + 150, 3 * 40 + 150, (llm, ids["long"]))


@pytest.mark.slow
def test_05_1_steps_and_outputs_of_one_request(mp_run: tuple[LLM, dict[str, str]]) -> None:
    llm, ids = mp_run
    # cdiv(400, 64) = 7 chunk steps, then 3 decodes; one EngineCoreOutputs per sampled token.
    holds("05.1", (10, 4), (10, 10), (llm, ids["long"]))


@pytest.mark.slow
def test_09_1_steps_in_flight_with_async_scheduling(mp_run: tuple[LLM, dict[str, str]]) -> None:
    llm, ids = mp_run
    # Plain steps overlap two deep; a structured request's steps run one at a time.
    holds("09.1", (2, 1), (2, 2), (llm, [ids["A"], ids["B"], ids["C"]]))


@pytest.mark.slow
def test_09_2_grammar_waits_by_size(mp_run: tuple[LLM, dict[str, str]]) -> None:
    llm, ids = mp_run
    # B compiles a new grammar; C's schema is A's, compiled already.
    holds("09.2", ["B", "C"], ["C", "B"], (llm, {"B": ids["B"], "C": ids["C"]}))


@pytest.mark.slow
def test_09_4_bytes_of_the_largest_scheduler_output(mp_run: tuple[LLM, dict[str, str]]) -> None:
    llm, _ = mp_run
    sent = llm.query_traces(
        "SELECT bytes FROM crossings WHERE message_type = 'SchedulerOutput' AND side = 'send'"
    )
    holds("09.4", int(sent.bytes.max()) - 500, int(sent.bytes.max()) + 5000, llm)


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, str]]]:
    """Lesson 08's section 2, smaller: chats A and B, a 300-token prompt, chats C and D, under a
    64-token budget; its trace, open read-only."""
    from stepscope.traces.backend.store import TraceStore

    db = tmp_path_factory.mktemp("exercises-08") / "mixed.duckdb"
    order = ["A", "B", "long", "C", "D"]
    prompts = [
        list(range(3000, 3300)) if n == "long" else list(range(100 + 10 * i, 108 + 10 * i))
        for i, n in enumerate(order)
    ]
    params = [SamplingParams(max_tokens=2 if n == "long" else 8, **GREEDY) for n in order]
    with LLM(model="tiny-llama", max_num_batched_tokens=64, num_kv_blocks=128, trace_db=db) as llm:
        outs = llm.generate(prompts, params)
    with TraceStore(db, read_only=True) as store:
        yield store, {n: o.request_id for n, o in zip(order, outs, strict=True)}


@pytest.mark.slow
def test_08_2_chunks_and_the_budget_queue(mixed_run: tuple[Any, dict[str, str]]) -> None:
    # Step 0: A's and B's 16 prompt tokens, 48 of the long one; then 62 a step beside their two
    # decodes (48 + 4 x 62 = 296), and its last 4 tokens with C and D: C waited for budget.
    holds("08.2", (6, True), (5, True), mixed_run)


@pytest.mark.slow
def test_08_4_what_if_the_budget_changes(mixed_run: tuple[Any, dict[str, str]]) -> None:
    from stepscope.viz import whatif

    store, _ = mixed_run
    wi = whatif.whatif(store, {"max_num_batched_tokens": [32, 512]}, slos={})
    tpot = ["up" if r["tpot_mean_s"] > wi.self_check["tpot_mean_s"] else "down" for r in wi.rows]
    # Half the budget: the long prompt takes more chunks and C queues longer, so TTFT p90 rises;
    # eight times it: the prompt and every chat fit the first steps, so it falls.
    right = {32: ("up", tpot[0]), 512: ("down", tpot[1])}
    holds("08.4", right, {32: ("down", tpot[0]), 512: ("down", tpot[1])}, wi)
