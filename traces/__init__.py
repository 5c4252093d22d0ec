"""Tracing for stepscope: OpenTelemetry spans for every request, engine step and boundary crossing.

Modules: `names` (span names and attribute keys, the contract), `setup` (one TracerProvider per
process), `spans` (the helpers the engine calls), `store` (DuckDB tables and views), `collector`
(the OTLP/HTTP receiver process), `queries`, `cli` and `bench`. See docs/tracing.md.
"""
