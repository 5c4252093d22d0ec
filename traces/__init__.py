"""Tracing for stepscope: OpenTelemetry spans for every request, engine step and boundary crossing.

Modules: `names` (span names and attribute keys, the contract), `setup` (one TracerProvider per
process), `spans` (the helpers the engine calls), `crossing` (`traced_send` /
`traced_receive` at each end of each boundary), `process` (parent watch and free ports for every
process, the collector included), `store` (DuckDB tables and views), `collector` (the OTLP/HTTP
receiver process), `queries`, `cli` and `bench`. See docs/tracing.md.
"""
