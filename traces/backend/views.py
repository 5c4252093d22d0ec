"""The trace file's schema: the `spans` table and the views that read it, as SQL.

Table `spans` holds one row per span (ids as lowercase hex, attributes/events/links/resource as
JSON). The views `requests`, `steps`, `crossings`, `step_requests`, `worker_steps`,
`dp_loads` and `runs` are the contract the dashboard, CLI and tutorials read; docs/tracing.md
lists their columns. `create_schema` makes both in a file opened for writing (`store.TraceStore`).
"""

from __future__ import annotations

import duckdb

from stepscope.traces import names as n

COLUMNS = (
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "kind",
    "service_name",
    "rank",
    "start_ns",
    "end_ns",
    "duration_ns",
    "status",
    "attributes",
    "events",
    "links",
    "resource",
)

CREATE_SPANS = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id VARCHAR NOT NULL,
    span_id VARCHAR NOT NULL,
    parent_span_id VARCHAR,
    name VARCHAR NOT NULL,
    kind VARCHAR,
    service_name VARCHAR,
    rank INTEGER,
    start_ns BIGINT,
    end_ns BIGINT,
    duration_ns BIGINT,
    status VARCHAR,
    attributes JSON,
    events JSON,
    links JSON,
    resource JSON
)
"""


def _num(key: str, sql_type: str = "BIGINT", column: str = "attributes") -> str:
    return f"""CAST(json_extract({column}, '$."{key}"') AS {sql_type})"""


def _str(key: str, column: str = "attributes") -> str:
    return f"""json_extract_string({column}, '$."{key}"')"""


def _event_ns(event: str) -> str:
    """Time of the first event named `event` of a span, in ns (NULL when absent)."""
    return (
        "list_min([CAST(json_extract(e, '$.time_ns') AS BIGINT) "
        f"FOR e IN CAST(events AS JSON[]) IF json_extract_string(e, '$.name') = '{event}'])"
    )


def dp_rank_sql(prefix: str = "") -> str:
    """The data-parallel rank of a span: its own attribute (API-side spans name the rank they
    talk to), else its process's (engine cores and workers), else 0 (one rank only)."""
    return (
        f"coalesce({_num(n.DP_RANK, 'INTEGER', column=prefix + 'attributes')}, "
        f"{_num(n.DP_RANK, 'INTEGER', column=prefix + 'resource')}, 0)"
    )


def _array_len(key: str) -> str:
    return f"""coalesce(json_array_length(attributes, '$."{key}"'), 0)"""


# The rank-0 worker's step (the rank that replies), for the `steps` view: its process CPU time,
# its wall time and the threads its forward could use, joined by the step's trace and index.
_RANK0_WORKER_STEPS = f"""
SELECT trace_id AS worker_trace_id, {_num(n.STEP)} AS worker_step,
       {_num(n.CPU_TIME_NS)} / 1e9 AS cpu_s, duration_ns / 1e9 AS worker_s,
       {_num(n.NUM_THREADS, "INTEGER")} AS num_threads
FROM spans
WHERE name = '{n.WORKER_STEP}' AND coalesce({_num(n.RANK, "INTEGER")}, rank) = 0
"""

VIEWS = {
    "requests": f"""
WITH r AS (
    SELECT *,
        {_event_ns(n.RequestEvent.QUEUED)} AS queued_ns,
        {_event_ns(n.RequestEvent.SCHEDULED)} AS scheduled_ns,
        {_event_ns(n.RequestEvent.GRAMMAR_READY)} AS grammar_ready_ns,
        {_event_ns(n.RequestEvent.FIRST_TOKEN)} AS first_token_ns,
        {_event_ns(n.RequestEvent.FINISHED)} AS finished_ns
    FROM spans WHERE name = '{n.REQUEST}'
)
SELECT
    {_str(n.REQUEST_ID)} AS request_id,
    trace_id,
    span_id,
    {_str(n.GEN_AI_REQUEST_MODEL)} AS model,
    {_str(n.GEN_AI_OPERATION_NAME)} AS operation,
    start_ns,
    end_ns,
    queued_ns,
    scheduled_ns,
    first_token_ns,
    finished_ns,
    (scheduled_ns - queued_ns) / 1e9 AS queue_time_s,
    (first_token_ns - start_ns) / 1e9 AS ttft_s,
    (end_ns - start_ns) / 1e9 AS e2e_s,
    {_num(n.GEN_AI_USAGE_INPUT_TOKENS)} AS input_tokens,
    {_num(n.GEN_AI_USAGE_OUTPUT_TOKENS)} AS output_tokens,
    {_num(n.NUM_CACHED_TOKENS)} AS cached_tokens,
    {_num(n.NUM_PREEMPTIONS)} AS num_preemptions,
    json_extract_string(attributes, '$."{n.GEN_AI_RESPONSE_FINISH_REASONS}"[0]') AS finish_reason,
    {dp_rank_sql()} AS dp_rank,
    {_num(n.PROMPT_BLOCK_HASHES, "VARCHAR[]")} AS prompt_block_hashes,
    CAST({_str(n.SAMPLING_PARAMS)} AS JSON) AS sampling_params,
    {_num(n.PROMPT_TOKEN_IDS, "BIGINT[]")} AS prompt_token_ids,
    grammar_ready_ns
FROM r
""",
    # One row per `stepscope.run` span: each front end (LLM, AsyncLLM; each API server) records
    # the configuration it runs once, as it starts.
    "runs": f"""
SELECT
    {_str(n.ENTRY)} AS entry,
    CAST(json_extract(CAST({_str(n.ENGINE_CONFIG)} AS JSON), '$.cache_config.block_size')
        AS INTEGER) AS block_size,
    CAST({_str(n.ENGINE_CONFIG)} AS JSON) AS engine_config,
    service_name,
    start_ns,
    trace_id,
    span_id
FROM spans WHERE name = '{n.RUN}'
""",
    "steps": f"""
SELECT
    {_num(n.STEP)} AS step,
    start_ns,
    end_ns,
    duration_ns / 1e9 AS duration_s,
    {_num(n.NUM_RUNNING)} AS num_running,
    {_num(n.NUM_WAITING)} AS num_waiting,
    {_num(n.NUM_DECODE_TOKENS)} AS num_decode_tokens,
    {_num(n.NUM_PREFILL_TOKENS)} AS num_prefill_tokens,
    {_num(n.TOKEN_BUDGET)} AS token_budget,
    {_num(n.KV_FREE_BEFORE)} AS kv_free_before,
    {_num(n.KV_FREE_AFTER)} AS kv_free_after,
    {_num(n.KV_TOTAL_BLOCKS)} AS kv_total_blocks,
    {_num(n.PREFIX_HIT_TOKENS)} AS prefix_hit_tokens,
    {_str(n.WAITING_REASON)} AS waiting_reason,
    coalesce({_num(n.WAITING_REASON_COUNT)}, 0) AS waiting_reason_count,
    coalesce({_num(n.KV_BLOCKS_SHORT)}, 0) AS kv_blocks_short,
    {_num(n.NUM_CONTEXT_TOKENS)} AS num_context_tokens,
    {_num(n.KV_BLOCKS_BY_GROUP, "BIGINT[]")} AS kv_blocks_by_group,
    {_num(n.KV_GROUP_WINDOWS, "BIGINT[]")} AS kv_group_windows,
    {_array_len(n.PREEMPTED_IDS)} AS num_preempted,
    {_array_len(n.FINISHED_IDS)} AS num_finished,
    {dp_rank_sql()} AS dp_rank,
    w.cpu_s,
    w.worker_s,
    w.num_threads,
    trace_id,
    span_id
FROM spans
LEFT JOIN ({_RANK0_WORKER_STEPS}) w
    ON w.worker_trace_id = spans.trace_id AND w.worker_step = {_num(n.STEP)}
WHERE name = '{n.ENGINE_STEP}'
""",
    "crossings": f"""
SELECT
    {_str(n.BOUNDARY)} AS boundary,
    CASE name WHEN '{n.SEND}' THEN 'send' ELSE 'receive' END AS side,
    {_str(n.MESSAGE_TYPE)} AS message_type,
    {_num(n.MESSAGE_BODY_SIZE)} AS bytes,
    {_num(n.NUM_REQUESTS)} AS num_requests,
    start_ns,
    end_ns,
    trace_id,
    span_id,
    parent_span_id,
    service_name,
    rank,
    {dp_rank_sql()} AS dp_rank
FROM spans WHERE name IN ('{n.SEND}', '{n.RECEIVE}')
""",
    "step_requests": f"""
SELECT
    step, unnest(ids) AS request_id, unnest(num_tokens) AS num_tokens, start_ns, end_ns, dp_rank
FROM (
    SELECT
        {_num(n.STEP)} AS step,
        {dp_rank_sql()} AS dp_rank,
        coalesce({_num(n.REQUEST_IDS, "VARCHAR[]")}, []) AS ids,
        coalesce({_num(n.REQUEST_NUM_TOKENS, "BIGINT[]")}, []) AS num_tokens,
        start_ns,
        end_ns
    FROM spans WHERE name = '{n.ENGINE_STEP}'
)
""",
    "worker_steps": f"""
SELECT
    {_num(n.STEP, column="w.attributes")} AS step,
    coalesce({_num(n.RANK, "INTEGER", column="w.attributes")}, w.rank) AS rank,
    {dp_rank_sql("w.")} AS dp_rank,
    w.start_ns,
    w.end_ns,
    sum(c.duration_ns) FILTER (WHERE c.name = '{n.PREPARE_INPUTS}') / 1e9 AS prepare_s,
    sum(c.duration_ns) FILTER (WHERE c.name = '{n.FORWARD}') / 1e9 AS forward_s,
    sum(c.duration_ns) FILTER (WHERE c.name = '{n.SAMPLE}') / 1e9 AS sample_s,
    {_num(n.CPU_TIME_NS, column="w.attributes")} / 1e9 AS cpu_s,
    {_num(n.NUM_THREADS, "INTEGER", column="w.attributes")} AS num_threads
FROM spans w
LEFT JOIN spans c ON c.parent_span_id = w.span_id AND c.trace_id = w.trace_id
WHERE w.name = '{n.WORKER_STEP}'
GROUP BY w.trace_id, w.span_id, w.attributes, w.resource, w.rank, w.start_ns, w.end_ns
""",
    # One row per DP rank per publication of the DP coordinator: the load the API servers
    # routed by (the arrays of a `stepscope.dp_publish` span are indexed by rank).
    "dp_loads": f"""
SELECT
    time_ns,
    CAST(unnest(range(len(waiting))) AS INTEGER) AS dp_rank,
    unnest(waiting) AS num_waiting,
    unnest(running) AS num_running,
    unnest(lost) = 1 AS lost,
    unnest(age_ms) / 1e3 AS report_age_s,
    trace_id,
    span_id
FROM (
    SELECT
        start_ns AS time_ns,
        coalesce({_num(n.DP_NUM_WAITING, "BIGINT[]")}, []) AS waiting,
        coalesce({_num(n.DP_NUM_RUNNING, "BIGINT[]")}, []) AS running,
        coalesce({_num(n.DP_LOST, "BIGINT[]")}, []) AS lost,
        coalesce({_num(n.DP_REPORT_AGE_MS, "BIGINT[]")}, []) AS age_ms,
        trace_id,
        span_id
    FROM spans WHERE name = '{n.DP_PUBLISH}'
)
""",
}


def create_schema(con: duckdb.DuckDBPyConnection) -> None:
    """The `spans` table (if the file has none yet) and every view, replaced."""
    con.execute(CREATE_SPANS)
    for view, sql in VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {view} AS {sql}")
