"""Models the engine can run: names, weights on disk and the Llama forward over paged KV."""
