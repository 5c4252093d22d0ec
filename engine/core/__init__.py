"""The engine core, in the engine-core process (in the caller's process with the in-process
client): the busy loop and its two IO threads, `EngineCore` (schedule -> execute -> update), the
scheduler, the KV cache manager, the block pool and the engine-core view of a request."""
