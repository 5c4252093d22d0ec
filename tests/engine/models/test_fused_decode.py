"""Small decode steps of GGUF weights run every layer in one C call (engine/models/
fused_decode.py): the same kernels in the same order as the Python forward, so the same tokens;
and where it does not apply, the reason."""

from __future__ import annotations

import pytest

from stepscope.engine import LLM, SamplingParams
from stepscope.kernels.cpu import build

pytestmark = pytest.mark.skipif(build.available() is not None, reason="no C compiler")

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "Les chats"]


def model_of(llm: LLM):
    return llm.frontend.client.core.executor.worker.model_runner.model


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_fused_decode_gives_the_python_forwards_tokens(dtype):
    # Four prompts: decode steps of 4 tokens (fused) after prefill steps (not), then of 3 and
    # fewer as the max_tokens stops come. No dense copy: every step runs the GGUF blocks.
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 9, 12, 16)
    ]
    tokens = {}
    for fused in (False, True):
        with LLM(
            num_kv_blocks=64, dtype=dtype, quantized_max_tokens=None, fused_decode=fused
        ) as llm:
            assert (model_of(llm).fused_decode is not None) == fused
            tokens[fused] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert tokens[True] == tokens[False]


def test_fused_decode_says_why_it_does_not_apply():
    from stepscope.engine.models.fused_decode import fused_decode_reason

    with LLM(model="tiny-llama", num_kv_blocks=16) as llm:
        assert model_of(llm).fused_decode is None
        assert "dense weights" in fused_decode_reason(model_of(llm))
