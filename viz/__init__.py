"""Panel dashboards and the scheduler simulator (stepscope.viz).

`simulator` runs the real `Scheduler` and `KVCacheManager` in a chosen state; `app` builds the
dashboard pages; `dashboard` serves them, alone or inside the trace collector. Kept light: Panel
is imported only by `app` and `dashboard`.
"""
