"""Executors, in the engine-core process: how a step reaches the workers. In-process (one worker
inside the engine core) or multiprocess (one worker process per tensor-parallel rank)."""
