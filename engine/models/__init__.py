"""Models, run in the worker processes: the Llama forward over the paged KV cache. `loader`
names the models and finds their weights on disk; every process that resolves a model name
uses it."""
