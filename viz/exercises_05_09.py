"""The checkers of lessons 05-09's exercises (see viz/exercises.py): each measures, from the
learner's own run, the quantity its exercise asks the learner to predict."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pandas as pd

from stepscope.viz.exercises import (
    cdiv,
    each,
    exercise,
    near,
    request_steps,
    sql_ids,
    trace_df,
    with_store,
)

# --- 09 · where the grammar lives ------------------------------------------------------------


def _in_flight(steps: pd.DataFrame) -> pd.Series:
    """Per step, how many steps were running when it started, itself included."""
    starts, ends = steps.start_ns.to_numpy(), steps.end_ns.to_numpy()
    return pd.Series([int(((starts <= s) & (ends > s)).sum()) for s in starts], index=steps.step)


@exercise(
    "09.1",
    answer="(most steps in flight while only plain requests run, while a structured one runs)",
    run="(trace path or store, [the structured requests' ids])",
    quantity="steps whose spans overlap (start_ns, end_ns in `steps`), split by step_requests",
)
def _09_1(run: tuple[Any, list[str]]) -> tuple[int, int]:
    trace, structured = run
    steps = trace_df(trace, "SELECT step, start_ns, end_ns FROM steps ORDER BY start_ns")
    flight = _in_flight(steps)
    with_structured = set(request_steps(trace, structured).step)
    plain = [n for step, n in flight.items() if step not in with_structured]
    grammar = [n for step, n in flight.items() if step in with_structured]
    return max(plain, default=0), max(grammar, default=0)


@exercise(
    "09.2",
    answer='the labels ordered by grammar wait, longest first, e.g. ["C", "B"]',
    run='(trace path or store, {"B": request_id, "C": request_id})',
    quantity="grammar waits, grammar_ready_ns - queued_ns in `requests`",
)
def _09_2(run: tuple[Any, Mapping[str, str]]) -> list[str]:
    trace, labels = run
    rows = trace_df(
        trace,
        f"SELECT request_id, grammar_ready_ns - queued_ns AS wait_ns FROM requests "
        f"WHERE request_id IN {sql_ids(labels.values())}",
    ).set_index("request_id")
    return sorted(labels, key=lambda label: -float(rows.wait_ns[labels[label]]))


def _instance(schema: Mapping[str, Any], char: str) -> str:
    """A JSON text for `schema` whose strings each hold `char` (raw, unescaped), spaced as
    xgrammar lays it out without any_whitespace (", " and ": ")."""
    parts = []
    for name, prop in schema["properties"].items():
        kind = prop.get("type")
        value = {"boolean": "true", "integer": str(prop.get("minimum", 0))}.get(kind, f'"A{char}"')
        parts.append(f'"{name}": {value}')
    return "{" + ", ".join(parts) + "}"


@exercise(
    "09.3",
    answer="the set of code points (ints) JSON forbids in a string that the raw grammar admits",
    run="SCHEMA, with the city's maxLength (the raw schema, not rewritten)",
    quantity="control characters 0x00-0x1f that xgrammar's raw grammar accepts inside a string",
)
def _09_3(schema: Mapping[str, Any]) -> set[int]:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return {c for c in range(0x20) if _is_grammar_accept_string(grammar, _instance(schema, chr(c)))}


@exercise(
    "09.4",
    answer="bytes of the largest SchedulerOutput the engine core sent",
    run="the trace of the eight requests (path or store)",
    quantity="largest `bytes` of a SchedulerOutput send in `crossings` (within 1 KB)",
    holds=near(1024),
)
def _09_4(trace: Any) -> int:
    sent = trace_df(
        trace,
        "SELECT max(bytes) AS b FROM crossings "
        "WHERE message_type = 'SchedulerOutput' AND side = 'send'",
    )
    return int(sent.b.iloc[0])


# --- 05 · ten stages, four boundaries --------------------------------------------------------


@exercise(
    "05.1",
    answer="(engine steps, EngineCoreOutputs sent)",
    run="(db, store or llm: section 1's trace, rid)",
    quantity="the request's steps, and its engine_core->api sends (queries.request_path)",
)
def _05_1(run: tuple[Any, str]) -> tuple[int, int]:
    from stepscope.traces.backend import queries

    trace, rid = run
    path = with_store(trace, lambda store: queries.request_path(store, rid))
    c = path.crossings
    sent = c[(c.boundary == "engine_core->api") & (c.side == "send")]
    return len(path.steps), len(sent)


@exercise(
    "05.2",
    answer="characters of the first token held back",
    run="held (section 2's stop-string table, from your SamplingParams)",
    quantity='the first token\'s length less its "delta sent"',
)
def _05_2(held: pd.DataFrame) -> int:
    return len(held.token.iloc[0]) - len(held["delta sent"].iloc[0])


_PIECES = {"body": 0, "handler": 1, "prefill": 4}  # rows of section 5's `split` table


@exercise(
    "05.3",
    answer='the pieces "body", "handler" and "prefill" ordered by time, longest first',
    run="split (section 5's table, from the request with the question repeated 50 times)",
    quantity="ms of the rows 'HTTP in, before any span', '1 · handler' and '4-8 · prefill'",
)
def _05_3(split: pd.DataFrame) -> list[str]:
    ms = {name: float(split.ms.iloc[row]) for name, row in _PIECES.items()}
    return sorted(ms, key=lambda name: -ms[name])


# --- 06 · consequences you can compute -------------------------------------------------------


@exercise(
    "06.1",
    answer="(the chunks of 192 tokens beside 20 decodes, the fewest decodes needing > 10 steps)",
    run="prefill_beside (the function of section 2; it runs the real scheduler)",
    quantity="prefill_beside(20, 192, 80, 16)'s chunks, and len(chunks) > 10 scanned over decodes",
)
def _06_1(prefill_beside: Any) -> tuple[list[int], int | None]:
    chunks = prefill_beside(20, 192, budget=80, block_size=16)[0]
    slow = (d for d in range(80) if len(prefill_beside(d, 192, budget=80, block_size=16)[0]) > 10)
    return chunks, next(slow, None)


@exercise(
    "06.2",
    answer="(prefix-hit tokens, tokens the new request still computes)",
    run='share["prefix caching on"] (section 4\'s table, with the 150-token prefix)',
    quantity="prefix_hit_tokens and new_request_tokens summed over the table",
)
def _06_2(on: pd.DataFrame) -> tuple[int, int]:
    return int(on.prefix_hit_tokens.sum()), int(on.new_request_tokens.sum())


@exercise(
    "06.3",
    answer="the largest new_blocks - cdiv(tokens, BLOCK) of any step",
    run="(runs[16], BLOCK) from the rerun with block_size=32",
    quantity="new_blocks - cdiv(decode + prefill, BLOCK) per step, at its largest",
)
def _06_3(run: tuple[pd.DataFrame, int]) -> int:
    steps, block = run
    tokens = steps.decode + steps.prefill
    return int(max(n - cdiv(t, block) for n, t in zip(steps.new_blocks, tokens, strict=True)))


# --- 07 · limits -----------------------------------------------------------------------------


@exercise(
    "07.1",
    answer="{8: True or False, 11: ..., 12: ...}: does a re-admitted request hit the cache",
    run="{8: preemptions(...), 11: ..., 12: ...}, each pool's preemption table",
    quantity="hits summed over each pool's preemptions",
)
@each
def _07_1(events: pd.DataFrame) -> bool:
    return bool(len(events)) and int(events.hits.sum()) > 0


@exercise(
    "07.2",
    answer="[prefill steps of each length in `lengths`], under a 128-token budget",
    run="best (section 2's table, rerun with budget 128)",
    quantity='the "prefill steps" column',
)
def _07_2(best: pd.DataFrame) -> list[int]:
    return [int(n) for n in best["prefill steps"]]


@exercise(
    "07.3",
    answer='"grows" or "same": the gap with 16 requests against 4',
    run="{4: gap_ms, 16: gap_ms} (section 1's gaps, a Series each)",
    quantity='median gap, 16 against 4 requests ("grows" when over 1.25 times)',
)
def _07_3(gaps: Mapping[int, pd.Series]) -> str:
    ratio = float(pd.Series(gaps[16]).median() / pd.Series(gaps[4]).median())
    return "grows" if ratio > 1.25 else "same"


@exercise(
    "07.4",
    answer="([requests on rank 0, on rank 1], the rank that scheduled more tokens)",
    run="per_rank (section 5's table, from your run)",
    quantity='the "requests" column and the rank with the most "tokens scheduled"',
)
def _07_4(per_rank: pd.DataFrame) -> tuple[list[int], int]:
    busiest = int(per_rank["tokens scheduled"].idxmax())
    return [int(n) for n in per_rank.requests], busiest


# --- 08 · why was this request slow ----------------------------------------------------------


def _largest(results: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    from stepscope.traces.backend.explain import largest_part

    return {name: largest_part(r)[0] for name, r in results.items()}


@exercise(
    "08.1",
    answer='{"A": part, "B": ..., "C": ..., "D": ...}, each chat\'s largest part, e.g. "queue_s"',
    run="{name: mixed[name] for name in 'ABCD'} (explain's results, long prompt first)",
    quantity="largest_part of each explain result",
)
def _08_1(results: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    return _largest(results)


@exercise(
    "08.2",
    answer="(the long prompt's chunks, whether C waits for budget: True or False)",
    run="(mixed_store, dict(zip(order, mixed_ids))) from the run with BUDGET = 1024",
    quantity="the long prompt's steps up to its prompt length, and explain(C)'s budget queue",
)
def _08_2(run: tuple[Any, Mapping[str, str]]) -> tuple[int, bool]:
    from stepscope.traces.backend.explain import explain

    store, ids = run
    long_id = ids["long"]
    n_prompt = int(
        trace_df(
            store, f"SELECT input_tokens FROM requests WHERE request_id IN {sql_ids([long_id])}"
        ).input_tokens.iloc[0]
    )
    rows = request_steps(store, [long_id])
    chunks = int((rows.num_tokens.cumsum().shift(fill_value=0) < n_prompt).sum())
    waits = explain(store, ids["C"])["queue_reasons"].get("budget", 0) > 0
    return chunks, bool(waits)


@exercise(
    "08.3",
    answer="{request: (preemptions, recomputed tokens)} for each request preempted",
    run="pool (section 4's explain results, with eight blocks)",
    quantity="preemptions and recomputed_tokens of each explain result",
)
def _08_3(pool: Mapping[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
    return {
        name: (r["preemptions"], r["recomputed_tokens"])
        for name, r in pool.items()
        if r["preemptions"]
    }


@exercise(
    "08.4",
    answer='{setting: ("up" or "down" for TTFT p90, "up" or "down" for mean TPOT)}',
    run="wi, the grid's whatif result",
    quantity="each row's ttft_p90_s and tpot_mean_s against wi.self_check (recorded settings)",
)
def _08_4(wi: Any) -> dict[Any, tuple[str, str]]:
    def way(row: Mapping[str, Any], key: str) -> str:
        return "up" if row[key] > wi.self_check[key] else "down"

    moves = {}
    for row in wi.rows:
        values = list(row["settings"].values())
        label = values[0] if len(values) == 1 else tuple(row["settings"].items())
        moves[label] = (way(row, "ttft_p90_s"), way(row, "tpot_mean_s"))
    return moves
