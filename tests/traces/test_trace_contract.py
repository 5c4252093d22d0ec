"""The names and view columns are contracts: docs/tracing.md lists every one, the views match."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepscope.traces import names
from stepscope.traces.backend.store import TraceStore

DOC = Path(__file__).resolve().parents[2] / "docs" / "tracing.md"

VIEW_COLUMNS = {
    "requests": "request_id, trace_id, span_id, model, operation, start_ns, end_ns, queued_ns, "
    "scheduled_ns, first_token_ns, finished_ns, queue_time_s, ttft_s, e2e_s, input_tokens, "
    "output_tokens, cached_tokens, num_preemptions, finish_reason, dp_rank, prompt_block_hashes, "
    "sampling_params, prompt_token_ids, grammar_ready_ns",
    "steps": "step, start_ns, end_ns, duration_s, num_running, num_waiting, num_decode_tokens, "
    "num_prefill_tokens, token_budget, kv_free_before, kv_free_after, kv_total_blocks, "
    "prefix_hit_tokens, waiting_reason, waiting_reason_count, kv_blocks_short, "
    "num_context_tokens, kv_blocks_by_group, kv_group_windows, num_preempted, "
    "num_finished, dp_rank, cpu_s, worker_s, num_threads, trace_id, span_id",
    "crossings": "boundary, side, message_type, bytes, num_requests, start_ns, end_ns, trace_id, "
    "span_id, parent_span_id, service_name, rank, dp_rank",
    "step_requests": "step, request_id, num_tokens, start_ns, end_ns, dp_rank",
    "worker_steps": "step, rank, dp_rank, start_ns, end_ns, prepare_s, forward_s, sample_s, "
    "cpu_s, num_threads",
    "runs": "entry, block_size, engine_config, service_name, start_ns, trace_id, span_id",
}


def _constants() -> dict[str, str]:
    return {
        key: value for key, value in vars(names).items() if key.isupper() and isinstance(value, str)
    }


@pytest.mark.parametrize(("constant", "value"), sorted(_constants().items()))
def test_every_name_is_documented(constant, value):
    assert f"`{value}`" in DOC.read_text(), constant


def test_span_names_are_unique_and_namespaced():
    assert len(set(names.SPAN_NAMES)) == len(names.SPAN_NAMES)
    assert all(name.startswith("stepscope.") for name in names.SPAN_NAMES)


def test_views_have_the_contract_columns(tmp_path):
    store = TraceStore(tmp_path / "empty.duckdb")
    for view, columns in VIEW_COLUMNS.items():
        described = [row[0] for row in store.con.execute(f"DESCRIBE {view}").fetchall()]
        assert described == columns.split(", "), view
        assert f"| `{view}` | `{columns}" in DOC.read_text(), view
