"""Which decoder runs a checkpoint (worker start-up): Gemma 3's own forward (gemma3.py), or the
one Llama and Qwen share (llama.py)."""

from __future__ import annotations

from stepscope.engine.models.config import ModelShape
from stepscope.engine.models.llama import LlamaModel


def model_class(shape: ModelShape) -> type[LlamaModel]:
    if shape.is_gemma3:
        from stepscope.engine.models.gemma3 import Gemma3Model

        return Gemma3Model
    return LlamaModel
