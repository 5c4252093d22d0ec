"""Entry points, in the process the user starts: the `stepscope` CLI, `stepscope serve` and its
OpenAI-compatible HTTP server (the API-server process), the offline `LLM` (the user's own Python
process), and the demo. They hand requests to `frontend/`."""
