"""The triton attention backend runs the whole Llama forward on the Triton kernels (RMSNorm with
the residual add, rotary, SiLU-and-mul, KV write, paged attention) and gives the torch backend's
greedy tokens. On CPU the kernels run in Triton's interpreter (tests/conftest.py), so the model
is tiny-llama and outputs are short."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest

from stepscope.engine import LLM, SamplingParams

# Kernel name -> (module, jitted kernel it launches).
KERNELS = {
    "rms_norm": ("stepscope.kernels.rms_norm", "_rms_norm_kernel"),
    "rotary_embedding": ("stepscope.kernels.rotary_embedding", "_rotary_embedding_kernel"),
    "silu_and_mul": ("stepscope.kernels.silu_and_mul", "_silu_and_mul_kernel"),
    "kv_cache_write": ("stepscope.kernels.kv_cache_write", "_write_kv_cache_kernel"),
    "paged_attention": ("stepscope.kernels.paged_attention", "_paged_attention_kernel"),
}
TOKEN_BUDGET = 32  # max_num_batched_tokens: the long prompt's prefill takes two steps
LONG_PROMPT = "The history of the Roman Empire began " * 6
SHORT_PROMPT = "Hello world"


def make_llm(backend: str, block_size: int) -> LLM:
    return LLM(
        model="tiny-llama",
        attention_backend=backend,
        block_size=block_size,
        num_kv_blocks=16,
        max_num_batched_tokens=TOKEN_BUDGET,
    )


def greedy_tokens(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture
def kernel_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Launches of each kernel, counted when `kernel[grid](...)` returns."""
    kernels = {
        name: getattr(importlib.import_module(module), attr)
        for name, (module, attr) in KERNELS.items()
    }
    name_of = {id(kernel): name for name, kernel in kernels.items()}
    counts = dict.fromkeys(KERNELS, 0)
    # `kernel[grid]` is looked up on the class (JITFunction, or InterpretedFunction on CPU).
    for cls in {type(kernel) for kernel in kernels.values()}:

        def counting_getitem(self, grid, _getitem=cls.__getitem__):
            launch = _getitem(self, grid)
            name = name_of.get(id(self))
            if name is None:
                return launch

            def counted_launch(*args, **kwargs):
                result = launch(*args, **kwargs)
                counts[name] += 1
                return result

            return counted_launch

        monkeypatch.setattr(cls, "__getitem__", counting_getitem)
    yield counts


@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_greedy_tokens_match_torch_under_chunked_prefill(block_size: int) -> None:
    prompts = [LONG_PROMPT, SHORT_PROMPT]
    torch_llm = make_llm("torch", block_size)
    assert len(torch_llm.tokenizer.encode(LONG_PROMPT)) > TOKEN_BUDGET  # prefill is chunked
    expected = greedy_tokens(torch_llm, prompts, max_tokens=3)
    actual = greedy_tokens(make_llm("triton", block_size), prompts, max_tokens=3)
    assert actual == expected


def test_triton_backend_launches_all_five_kernels(kernel_launches: dict[str, int]) -> None:
    greedy_tokens(make_llm("triton", 32), [SHORT_PROMPT], max_tokens=2)
    assert all(n > 0 for n in kernel_launches.values()), kernel_launches


def test_torch_backend_launches_no_kernel(kernel_launches: dict[str, int]) -> None:
    greedy_tokens(make_llm("torch", 32), [SHORT_PROMPT], max_tokens=2)
    assert all(n == 0 for n in kernel_launches.values()), kernel_launches
