"""`stepscope bench sampling --structured`: what structured outputs cost, from the trace.

Two runs of the model through `LLM` with its engine core and worker in processes of their own
(`executor="mp"`: the engine core's real busy loop, woken by a finished compile), each traced:

1. `--streams` concurrent chat requests constrained by a small JSON schema: the engine core's
   `stepscope.grammar_bitmask` spans (each structured request's matcher fills its row) and the
   worker's `stepscope.apply_grammar_bitmask` spans (the logits masked), summed against the
   worker's `stepscope.forward` spans, and how many outputs validate against the schema.
2. `--streams` plain streams decoding when a request with a `COMPILE_PROPERTIES`-property schema
   arrives: the plain streams' inter-token latency (from the steps that served them) before it
   arrived and while its grammar compiled, and the longest gap between steps in each window. A
   step that waited on the compile would show as a gap as long as the compile.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from stepscope.engine.bench.sampling import QUESTIONS
from stepscope.engine.sampling_params import SamplingParams, StructuredOutputsParams
from stepscope.traces import names

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 80},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "topics": {
            "type": "array",
            "items": {"enum": ["science", "life", "food", "other"]},
            "maxItems": 3,
        },  # fmt: skip
    },
    "required": ["answer", "confidence", "topics"],
    "additionalProperties": False,
}
COMPILE_PROPERTIES = 2000
WARMUP_ROUNDS = 8  # output rounds of the plain streams before the large schema arrives


def large_schema(num_properties: int = COMPILE_PROPERTIES) -> dict:
    kinds = ({"type": "integer"}, {"type": "string", "maxLength": 8}, {"type": "boolean"})
    return {
        "type": "object",
        "properties": {f"field_{i}": kinds[i % 3] for i in range(num_properties)},
        # Every property required: optional ones are a different (and for xgrammar far
        # slower) grammar, a combination of which may come in which order.
        "required": list(f"field_{i}" for i in range(num_properties)),
    }


def _prompts(llm, num: int) -> list[list[int]]:
    return [
        llm.processor.apply_chat_template(
            [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} Answer in JSON."}]
        )
        for i in range(num)
    ]


def span_seconds(trace_db: Path, span_names: tuple[str, ...]) -> dict[str, tuple[int, float]]:
    """Span name -> (count, total seconds), for these names."""
    import duckdb

    marks = ", ".join("?" for _ in span_names)
    with duckdb.connect(str(trace_db), read_only=True) as con:
        rows = con.execute(
            "SELECT name, count(*), sum(end_ns - start_ns) / 1e9 FROM spans "
            f"WHERE name IN ({marks}) GROUP BY name",
            list(span_names),
        ).fetchall()
    return {name: (count, seconds) for name, count, seconds in rows}


def bitmask_share(model: str, streams: int, max_tokens: int, dtype: str, tmp: Path) -> None:
    """Part 1: the bitmask's spans against the forward's, with `streams` structured streams."""
    import jsonschema

    from stepscope.engine import LLM

    trace_db = tmp / "structured.duckdb"
    llm = LLM(model=model, dtype=dtype, executor="mp", trace_db=str(trace_db))
    try:
        params = SamplingParams(
            temperature=0.8, top_p=0.95, max_tokens=max_tokens,
            structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)),
        )  # fmt: skip
        start = time.perf_counter()
        outputs = llm.generate(_prompts(llm, streams), params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    valid = stopped = 0
    for out in outputs:
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            stopped += 1
            try:
                jsonschema.validate(json.loads(completion.text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    totals = span_seconds(
        trace_db, (names.FORWARD, names.GRAMMAR_BITMASK, names.APPLY_GRAMMAR_BITMASK)
    )
    steps, forward_s = totals.get(names.FORWARD, (0, 0.0))
    built_n, built_s = totals.get(names.GRAMMAR_BITMASK, (0, 0.0))
    applied_n, applied_s = totals.get(names.APPLY_GRAMMAR_BITMASK, (0, 0.0))
    if not steps or not built_n:
        raise ValueError(f"the trace holds no forward or grammar bitmask spans: {totals}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{streams} structured streams: {tokens} tokens in {seconds:.1f} s, {steps} steps; "
          f"{stopped} stopped at the grammar's end, {valid} of them valid")  # fmt: skip
    print(f"forward spans:          {forward_s * 1e3:,.0f} ms "
          f"({forward_s / steps * 1e3:.2f} ms a step)")  # fmt: skip
    print(f"grammar_bitmask spans:  {built_s * 1e3:,.1f} ms in {built_n} steps "
          f"({built_s / built_n * 1e3:.3f} ms a step)")  # fmt: skip
    print(f"apply_grammar_bitmask:  {applied_s * 1e3:,.1f} ms in {applied_n} steps "
          f"({applied_s / max(applied_n, 1) * 1e3:.3f} ms a step)")  # fmt: skip
    print(f"bitmask (build + apply) / forward: {(built_s + applied_s) / forward_s:.2%}")


def compile_beside_decodes(model: str, streams: int, dtype: str, tmp: Path) -> None:
    """Part 2: plain streams' inter-token latency before and while a large schema compiles."""
    from stepscope.engine import LLM
    from stepscope.traces.backend.store import TraceStore

    trace_db = tmp / "compile.duckdb"
    llm = LLM(model=model, dtype=dtype, executor="mp", trace_db=str(trace_db))
    try:
        plain = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=96, ignore_eos=True)
        big = SamplingParams(
            temperature=0.8, max_tokens=8,
            structured_outputs=StructuredOutputsParams(json=json.dumps(large_schema())),
        )  # fmt: skip
        frontend, ids = llm.frontend, iter(range(10**9))
        for tokens in _prompts(llm, streams):
            parent = frontend.make_request(f"plain-{next(ids)}", tokens, plain, time.time())
            llm.send(parent, names.OPERATION_CHAT)
        rounds = 0
        while frontend.output_processor.has_unfinished_requests():
            llm.collect()
            rounds += 1
            if rounds == WARMUP_ROUNDS:
                tokens = _prompts(llm, 1)[0]
                schema_request = frontend.make_request("schema", tokens, big, time.time())
                llm.send(schema_request, names.OPERATION_CHAT)
        frontend.release_all()
    finally:
        llm.shutdown()
    store = TraceStore(str(trace_db), read_only=True)
    try:
        req = store.df("SELECT request_id, queued_ns, grammar_ready_ns FROM requests")
        row = req[req["grammar_ready_ns"].notna()].iloc[0]
        queued, ready = int(row["queued_ns"]), int(row["grammar_ready_ns"])
        served = store.df(
            "SELECT request_id, end_ns FROM step_requests WHERE request_id != $1 ORDER BY end_ns",
            [row["request_id"]],
        )
        steps = store.df("SELECT start_ns, end_ns FROM steps ORDER BY start_ns")
    finally:
        store.close()
    before: list[float] = []
    during: list[float] = []
    for _, group in served.groupby("request_id"):
        ends = group["end_ns"].tolist()
        for a, b in zip(ends, ends[1:], strict=False):
            if b <= queued:
                before.append((b - a) / 1e6)
            elif queued < b <= ready:
                during.append((b - a) / 1e6)
    starts = steps["start_ns"].tolist()
    gaps_before = [(b - a) / 1e6 for a, b in zip(starts, starts[1:], strict=False) if b <= queued]
    gaps_during = [
        (b - a) / 1e6 for a, b in zip(starts, starts[1:], strict=False) if queued < b <= ready
    ]
    print(f"a {COMPILE_PROPERTIES}-property schema compiled in {(ready - queued) / 1e6:.0f} ms "
          f"while {streams} plain streams decoded")  # fmt: skip
    for label, itl, gaps in (("before", before, gaps_before), ("during", during, gaps_during)):
        if not itl:
            print(f"  {label}: no decode step in this window")
            continue
        print(f"  {label}: inter-token latency median {statistics.median(itl):.1f} ms, "
              f"p90 {_p90(itl):.1f} ms over {len(itl)} tokens; {len(gaps) + 1} steps, "
              f"longest gap between step starts {max(gaps, default=0):.1f} ms")  # fmt: skip


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def run_bench_structured(model: str, streams: int, max_tokens: int, dtype: str) -> int:
    print(f"{model} ({dtype}), engine core and worker in their own processes", flush=True)
    with tempfile.TemporaryDirectory(prefix="stepscope-bench-structured-") as tmp:
        bitmask_share(model, streams, max_tokens, dtype, Path(tmp))
        compile_beside_decodes(model, streams, dtype, Path(tmp))
    return 0
