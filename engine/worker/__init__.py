"""Workers, in the worker processes (inside the engine-core process with the in-process executor):
the process's entry and loop (worker_proc, with the headless launcher of a worker machine), the
worker, its model runner (inputs, forward, sampling; it picks the attention backend from
engine/layers) and the sampler."""
