"""`stepscope serve`: the API server process, which starts the engine core and its workers."""

from __future__ import annotations

import argparse

import uvicorn

from stepscope.engine.api_server import build_app
from stepscope.engine.async_llm import AsyncLLM


def serve(args: argparse.Namespace) -> None:
    engine_args = dict(
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend,
        seed=args.seed,
        executor=args.executor,
        tensor_parallel_size=args.tp,
    )
    name = args.served_model_name or args.model
    # Validate the configuration before anything starts, so a typo fails fast and clearly.
    from stepscope.engine.config import EngineConfig

    EngineConfig(model=args.model, offline=False, **engine_args)
    app = build_app(
        lambda: AsyncLLM(args.model, **engine_args),
        model_name=name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
    )
    print(f"stepscope: serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
    )
