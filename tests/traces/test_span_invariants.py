"""Orders that cause and effect fix, checked on every step of a real run with every boundary a
process boundary (`LLM(executor="mp", tensor_parallel_size=2)`, chunked prefill). Notebooks 04 and
05 show them in one picture each; these tests hold them for every step and every crossing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stepscope.traces import names as n
from stepscope.traces.backend.store import TraceStore
from stepscope.viz.request_path import stage_occurrences


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[TraceStore]:
    from stepscope.engine import LLM, SamplingParams

    path = tmp_path_factory.mktemp("invariants") / "run.duckdb"
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with LLM(
        model="tiny-llama",
        executor="mp",
        tensor_parallel_size=2,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        trace_db=path,
    ) as llm:
        llm.generate([list(range(100, 140)), list(range(200, 210))], params, use_tqdm=False)
    with TraceStore(path, read_only=True) as store:
        yield store


def test_execute_starts_before_any_worker_step_and_holds_rank_0s_forward(store) -> None:
    # The engine core sends the step inside `execute` and waits there for rank 0's answer.
    per_step = store.df(f"""
        SELECT s.step,
            max(c.start_ns) FILTER (WHERE c.name = '{n.EXECUTE}') AS execute_start,
            max(c.end_ns) FILTER (WHERE c.name = '{n.EXECUTE}') AS execute_end,
            min(w.start_ns) FILTER (WHERE w.name = '{n.WORKER_STEP}') AS first_worker_start,
            min(w.start_ns) FILTER (WHERE w.name = '{n.FORWARD}' AND w.rank = 0) AS forward0_start,
            max(w.end_ns) FILTER (WHERE w.name = '{n.FORWARD}' AND w.rank = 0) AS forward0_end
        FROM steps s
        JOIN spans c ON c.parent_span_id = s.span_id AND c.trace_id = s.trace_id
        JOIN spans w ON w.trace_id = s.trace_id AND w.service_name = '{n.SERVICE_WORKER}'
        GROUP BY s.step""")
    assert len(per_step) == store.count(n.EXECUTE) > 0  # every step that ran the model
    assert (per_step.execute_start <= per_step.first_worker_start).all()
    assert (per_step.execute_start <= per_step.forward0_start).all()
    assert (per_step.forward0_end <= per_step.execute_end).all()


def test_every_receive_is_the_child_of_a_send_on_its_boundary_in_another_process(store) -> None:
    crossings = store.df(
        "SELECT span_id, parent_span_id, boundary, side, service_name FROM crossings"
    )
    sends = crossings[crossings.side == "send"].set_index("span_id")
    receives = crossings[crossings.side == "receive"]
    assert set(receives.boundary) == set(n.BOUNDARIES)
    for receive in receives.itertuples():
        send = sends.loc[receive.parent_span_id]  # the trace context crossed in the message
        assert send.boundary == receive.boundary
        assert send.service_name != receive.service_name


def test_stages_4_to_8_run_in_path_order_within_every_step(store) -> None:
    # Rank 0's copy of stages 5 and 6: rank 1 may still be starting its step when rank 0 replies.
    request_ids = store.df("SELECT request_id FROM requests").request_id
    assert len(request_ids) == 2
    for rid in request_ids:
        _, occ = stage_occurrences(store, rid)
        path = occ[occ.stage.between(4, 8) & (occ["rank"].isna() | (occ["rank"] == 0))]
        assert path.step.nunique() > 1
        for step, stages in path.groupby("step"):
            assert list(stages.stage) == [4, 5, 6, 7, 8], (rid, step)
