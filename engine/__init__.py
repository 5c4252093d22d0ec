"""stepscope's serving engine: offline `LLM`, engine core, scheduler, KV cache and model runner.

`from stepscope.engine import LLM, SamplingParams` is the offline entry point. Names are resolved
lazily so that importing one submodule (say, the scheduler) does not load torch and transformers.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "stepscope.engine.entrypoints.llm",
    "SamplingParams": "stepscope.engine.sampling_params",
    "RequestOutput": "stepscope.engine.outputs",
    "CompletionOutput": "stepscope.engine.outputs",
    "RequestMetrics": "stepscope.engine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stepscope.engine' has no attribute {name!r}")
