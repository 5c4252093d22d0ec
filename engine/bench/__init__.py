"""Benchmarks, in the process that runs `stepscope bench ...`: offline (`LLM` against transformers,
executors and tracing side by side), serve (load a server), soak (faults and hostile input)."""
