"""Workers, in the worker processes (inside the engine-core process with the in-process executor):
the worker, its model runner (inputs, forward, sampling), the sampler and the attention backends."""
