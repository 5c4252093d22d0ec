"""Orders that cause and effect fix, checked on every step of a real run with every boundary a
process boundary (`LLM(executor="mp", tensor_parallel_size=2)`, chunked prefill, preemptions: the
session's TP=2 run). Notebooks 04 and 05 show them in one picture each; these tests hold them for
every step, every crossing and every request.
"""

from __future__ import annotations

from stepscope.traces import names as n
from stepscope.viz.request_path import stage_occurrences
from tests.traced_runs import TP2_PROMPTS

# `tp2_store`: the session's TP=2 run (tests/traced_runs.py), read-only (tests/traces/conftest.py).


def test_execute_starts_before_any_worker_step_and_holds_rank_0s_forward(tp2_store) -> None:
    # The engine core sends the step inside `execute` and waits there for rank 0's answer.
    per_step = tp2_store.df(f"""
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
    assert len(per_step) == tp2_store.count(n.EXECUTE) > 0  # every step that ran the model
    assert (per_step.execute_start <= per_step.first_worker_start).all()
    assert (per_step.execute_start <= per_step.forward0_start).all()
    assert (per_step.forward0_end <= per_step.execute_end).all()


def test_every_receive_is_the_child_of_a_send_on_its_boundary_in_another_process(tp2_store) -> None:
    crossings = tp2_store.df(
        "SELECT span_id, parent_span_id, boundary, side, service_name FROM crossings"
    )
    sends = crossings[crossings.side == "send"].set_index("span_id")
    receives = crossings[crossings.side == "receive"]
    assert set(receives.boundary) == set(n.BOUNDARIES)
    for receive in receives.itertuples():
        send = sends.loc[receive.parent_span_id]  # the trace context crossed in the message
        assert send.boundary == receive.boundary
        assert send.service_name != receive.service_name


def test_stages_4_to_8_run_in_path_order_within_every_step(tp2_store) -> None:
    # Rank 0's copy of stages 5 and 6: rank 1 may still be starting its step when rank 0 replies.
    request_ids = tp2_store.df("SELECT request_id FROM requests").request_id
    assert len(request_ids) == len(TP2_PROMPTS)
    for rid in request_ids:
        _, occ = stage_occurrences(tp2_store, rid)
        path = occ[occ.stage.between(4, 8) & (occ["rank"].isna() | (occ["rank"] == 0))]
        assert path.step.nunique() > 1
        for step, stages in path.groupby("step"):
            assert list(stages.stage) == [4, 5, 6, 7, 8], (rid, step)


def test_the_pieces_of_a_requests_ttft_follow_one_another(tp2_store) -> None:
    # Lesson 05 splits a client's TTFT at these events; each piece is a wait between two events in
    # causal order, so none is negative (request events are float seconds: about 1 us of slack).
    slack_ns = 1_000
    for rid in tp2_store.df("SELECT request_id FROM requests").request_id:
        request, occ = stage_occurrences(tp2_store, rid)
        stage2 = occ[occ.stage == 2].iloc[0]
        first_back = occ[occ.stage == 9].sort_values("start_ns").iloc[0]
        marks = [request["start_ns"], stage2.start_ns, stage2.end_ns, request["scheduled_ns"],
                 request["first_token_ns"], first_back.end_ns]  # fmt: skip
        gaps = [int(b) - int(a) for a, b in zip(marks, marks[1:], strict=False)]
        assert min(gaps) >= -slack_ns, (rid, gaps)
        assert request["ttft_s"] * 1e9 <= int(first_back.end_ns) - int(marks[0]) + slack_ns
