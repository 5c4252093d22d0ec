"""The front end, in the API-server process (or the user's process for offline `LLM`):
`AsyncLLM`, the clients that reach the engine-core process over ZMQ, input processing
(tokenize, validate), the output processor and its incremental detokenizer."""
