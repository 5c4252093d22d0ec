"""Tracing for stepscope: OpenTelemetry spans for every request, engine step and boundary crossing.

Two parts. The library every process loads, here: `names` (span names and attribute keys, the
contract), `setup` (one TracerProvider per process), `spans` (the helpers the engine calls),
`crossing` (`traced_send` / `traced_receive` at each end of each boundary), `process` (parent
watch, terminal signals and free ports, for every process, the collector included). The backend,
in `backend/`: the collector process, the DuckDB store and its views, queries, explain, export
and the `stepscope trace` commands; no process of the engine imports it to record spans. See
docs/tracing.md.
"""
