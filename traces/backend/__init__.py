"""The trace backend: what holds and reads the spans every process sends, apart from the library
every process loads (traces/: names, setup, spans, crossing).

The collector process (OTLP/HTTP in, one DuckDB writer; `collector.py`, and its parent's side in
`collector_process.py`), the DuckDB store and its views (`store.py`), the questions asked of a
trace (`queries.py`, `explain.py`), the Perfetto export (`export.py`), the `stepscope trace ...`
commands (`cli.py`) and the collector's benchmark (`bench.py`).
"""
