"""The checkers of lessons 00-04's exercises (see viz/exercises.py): each measures, from the
learner's own run, the quantity its exercise asks the learner to predict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from stepscope.viz.exercises import (
    cdiv,
    each,
    exercise,
    first_token_steps,
    near,
    request_steps,
    sql_ids,
    trace_df,
    within,
)

# --- 00 · quickstart --------------------------------------------------------------------------


@exercise(
    "00.1",
    answer="(engine steps, tokens in the first step)",
    run="(llm, the haiku's request_id)",
    quantity="steps that ran the request and tokens its first step computed (step_requests)",
)
def _00_1(run: tuple[Any, str]) -> tuple[int, int]:
    trace, rid = run
    rows = request_steps(trace, [rid])
    return len(rows), int(rows.num_tokens.iloc[0])


@exercise(
    "00.2",
    answer="(engine steps, most decode tokens in one step)",
    run="(llm, [each output's request_id])",
    quantity="steps that ran either conversation, and the largest num_decode_tokens among them",
)
def _00_2(run: tuple[Any, list[str]]) -> tuple[int, int]:
    trace, ids = run
    steps = sorted(set(request_steps(trace, ids).step))
    decode = trace_df(
        trace, f"SELECT num_decode_tokens FROM steps WHERE step IN ({', '.join(map(str, steps))})"
    )
    return len(steps), int(decode.num_decode_tokens.max())


@exercise(
    "00.3",
    answer="(processes serving the LLM, boundaries in `crossings`)",
    run='the LLM(executor="mp"), still open',
    quantity="pids in llm.processes() and distinct `boundary` values in the crossings view",
)
def _00_3(llm: Any) -> tuple[int, int]:
    boundaries = trace_df(llm, "SELECT DISTINCT boundary FROM crossings")
    return len({p.pid for p in llm.processes()}), len(boundaries)


# --- 01 · generation is a loop ---------------------------------------------------------------


@exercise(
    "01.1",
    answer="(prefill steps of the section-1 prompt, steps in all)",
    run="loop (section 1's table)",
    quantity="rows of `loop` up to the first one that sampled, and rows in all",
)
def _01_1(loop: pd.DataFrame) -> tuple[int, int]:
    sampled = [i for i, s in enumerate(loop.sampled) if len(s)]
    return sampled[0] + 1, len(loop)


@exercise(
    "01.2",
    answer="(decode tokens, prompt tokens, long-A's KV blocks)",
    run="(stats, snapshot) from section 3",
    quantity="stats.num_decode_tokens, stats.num_prefill_tokens and long-A's kv_blocks",
)
def _01_2(run: tuple[Any, pd.DataFrame]) -> tuple[int, int, int]:
    stats, snapshot = run
    blocks = int(snapshot.set_index("request").kv_blocks["long-A"])
    return stats.num_decode_tokens, stats.num_prefill_tokens, blocks


@exercise(
    "01.3",
    answer="[first-token step of by-hand, of the 20-token request], counted from the loop's 0",
    run='(llm, {"by-hand": len(prompt_ids), <second id>: 20})',
    quantity="step in which each request's scheduled tokens reach its prompt length",
)
def _01_3(run: tuple[Any, Mapping[str, int]]) -> list[int]:
    trace, prompts = run
    return first_token_steps(trace, prompts)


# --- 02 · why V1 split processes -------------------------------------------------------------


@exercise(
    "02.1",
    answer="(serving processes, every worker's parent is the engine core: True or False)",
    run='the LLM(executor="mp", tensor_parallel_size=2), still open',
    quantity="pids in llm.processes() and each worker's parent pid from the OS",
)
def _02_1(llm: Any) -> tuple[int, bool]:
    import psutil

    procs = llm.processes()
    cores = {p.pid for p in procs if p.role == "engine_core"}
    workers = [p.pid for p in procs if p.role == "worker"]
    return len({p.pid for p in procs}), all(psutil.Process(w).ppid() in cores for w in workers)


@exercise(
    "02.2",
    answer="bytes of the SchedulerOutput that carried the 2000-token prompt (within 10%)",
    run="(llm or its trace path, the 2000-token request's id)",
    quantity="largest engine_core->worker send in the steps that ran the request (crossings)",
    holds=within(0.10),
)
def _02_2(run: tuple[Any, str]) -> int:
    trace, rid = run
    sent = trace_df(
        trace,
        f"""SELECT max(c.bytes) AS b FROM crossings c
        JOIN steps s ON c.trace_id = s.trace_id
        JOIN step_requests sr ON sr.step = s.step AND sr.start_ns = s.start_ns
        WHERE c.boundary = 'engine_core->worker' AND c.side = 'send'
          AND sr.request_id IN {sql_ids([rid])}""",
    )
    return int(sent.b.iloc[0])


@exercise(
    "02.3",
    answer="{128: chunks, 256: chunks} of the 960-token prompt",
    run="{128: chunked, 256: chunked}, each from chats_then_long_prompt(...)",
    quantity="steps with prefill tokens in each table",
)
@each
def _02_3(chunked: pd.DataFrame) -> int:
    return int((chunked.prefill > 0).sum())


# --- 03 · choosing a batch -------------------------------------------------------------------


@exercise(
    "03.1",
    answer="(the first chunk's KV blocks, most crossing decodes A survives)",
    run="the settings: {**GROUP_A, **WALKTHROUGH_SETTINGS, 'block_size': 16, 'free_blocks': 256}",
    quantity="first_chunk_blocks, and the largest decodes_crossing still admitted (simulate_step)",
)
def _03_1(settings: Mapping[str, int]) -> tuple[int, int]:
    from stepscope.viz.simulator import simulate_step

    first = simulate_step(**settings)
    survived = [
        k
        for k in range(settings["running"] + 1)
        if simulate_step(**settings, decodes_crossing=k).admitted
    ]
    return first.first_chunk_blocks, max(survived, default=-1)


def _completes(settings: Mapping[str, int], free_blocks: int, output_len: int) -> bool:
    from stepscope.viz.simulator import simulate_steps

    state = {**settings, "free_blocks": free_blocks}
    steps = simulate_steps(**state, num_steps=output_len + 8, output_len=output_len)
    finished = any("p0" in s.finished for s in steps)
    return finished and not any("p0" in s.preempted for s in steps)


@exercise(
    "03.2",
    answer="the fewest free blocks at which p0 finishes its 4 tokens unpreempted",
    run="the settings: {**GROUP_A, **WALKTHROUGH_SETTINGS}",
    quantity="free_blocks searched with simulate_steps(..., output_len=4)",
)
def _03_2(settings: Mapping[str, int]) -> int:
    low = cdiv(settings["prompt_len"], settings["block_size"])  # too few for the prompt alone
    high = low + settings["running"] + cdiv(4, settings["block_size"]) + 1  # enough for all
    if not _completes(settings, high, 4):
        raise ValueError(f"p0 does not finish even with {high} free blocks")
    while high - low > 1:  # finishing needs more blocks, never fewer: bisect
        mid = (low + high) // 2
        low, high = (low, mid) if _completes(settings, mid, 4) else (mid, high)
    return high


@exercise(
    "03.3",
    answer="{32: [chunks], 128: [chunks]} of the 300-token prompt",
    run="{32: steps, 128: steps}, section 4's table for each budget",
    quantity='the nonzero "long prompt chunk" values of each table',
)
@each
def _03_3(steps: pd.DataFrame) -> list[int]:
    return [int(n) for n in steps["long prompt chunk"] if n > 0]


# --- 04 · who runs where ---------------------------------------------------------------------


@exercise(
    "04.1",
    answer="the sorted kinds of the server's processes, e.g. ['API server', ...]",
    run="the pid of `stepscope serve --model tiny-llama --tp 2`, while it runs",
    quantity="the kind of each process in the server's tree (process_table)",
)
def _04_1(pid: int) -> list[str]:
    import psutil

    from stepscope.viz.lessons import process_table

    return sorted(process_table(psutil.Process(pid), "API server").kind)


@exercise(
    "04.2",
    answer="the median share of execute that rank 0's forward fills (0 to 1, within 0.1)",
    run="per_step (section 5's query) over the TP = 4 trace",
    quantity="median of forward0_ns / execute_ns",
    holds=near(0.1),
)
def _04_2(per_step: pd.DataFrame) -> float:
    return round(float((per_step.forward0_ns / per_step.execute_ns).median()), 3)


@exercise(
    "04.3",
    answer="{1: processes, 2: processes} of vLLM's offline LLM without multiprocessing",
    run="{1: llm, 2: llm}: the stepscope LLMs you chose, still open",
    quantity="pids in each llm.processes()",
)
@each
def _04_3(llm: Any) -> int:
    return len({p.pid for p in llm.processes()})


@exercise(
    "04.4",
    answer='{"mp, TP=2": processes, "uni": processes}, the serving processes of each layout',
    run='{"mp, TP=2": dp_layout, "uni": dp_layout}, section 3\'s table for each run',
    quantity="distinct pids with a role in each dp_layout",
)
@each
def _04_4(layout: pd.DataFrame) -> int:
    return len(set(layout[layout.role.notna()].pid))
