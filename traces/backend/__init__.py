"""The trace backend: what holds and reads the spans every process sends, apart from the library
every process loads (traces/: names, setup, spans, crossing).

The collector process (OTLP/HTTP in, one DuckDB writer; `collector.py`, its parent's side in
`collector_process.py`, and its HTTP API from other processes in `client.py`), the trace file
(`views.py`: the table and views as SQL; `convert.py`: spans into column batches; `store.py`:
the DuckDB store), opening a trace to read (`source.py`: a file or a collector's URL, for every
reader), the questions asked of a trace (`queries.py`, `explain.py`), the Perfetto export
(`export.py`), the `stepscope trace ...` commands (`cli.py`) and the collector's benchmark
(`bench.py`).
"""
