"""Presence, frequency and repetition penalties in the worker's sampler: the batched op against a
per-row reference, the sampler around it, and end to end (greedy output against transformers,
under chunked prefill and preemption too)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from stepscope.engine import LLM, SamplingParams
from stepscope.engine.worker import sampler as sampler_mod
from stepscope.engine.worker.sampler import Sampler, apply_penalties

VOCAB = 40


def reference_penalties(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> list[float]:
    """One row, token by token, as vLLM's `apply_penalties` defines it."""
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t, count in Counter(output).items():
        out[t] -= frequency * count + presence
    return out


def padded(seqs: list[list[int]]) -> torch.Tensor:
    width = max(map(len, seqs), default=0)
    return torch.tensor([s + [VOCAB] * (width - len(s)) for s in seqs], dtype=torch.long).reshape(
        len(seqs), width
    )


@pytest.mark.parametrize("seed", range(5))
def test_penalties_equal_the_per_row_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = 6
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    logits[:, :4] = 0.0  # zero logits are multiplied, as vLLM does: they stay zero
    prompts, outputs = [], []
    for _ in range(rows):
        n_prompt, n_output = torch.randint(0, 12, (2,), generator=gen).tolist()
        prompts.append(torch.randint(0, VOCAB, (n_prompt,), generator=gen).tolist())
        # A small range for outputs, so that tokens repeat and counts exceed one.
        outputs.append(torch.randint(0, 8, (n_output,), generator=gen).tolist())
    presence = (torch.rand(rows, generator=gen) * 4 - 2).tolist()
    frequency = (torch.rand(rows, generator=gen) * 4 - 2).tolist()
    repetition = (torch.rand(rows, generator=gen) * 2 + 0.1).tolist()
    expected = [
        reference_penalties(logits[i].tolist(), prompts[i], outputs[i], *penalties)
        for i, penalties in enumerate(zip(presence, frequency, repetition, strict=True))
    ]
    got = logits.clone()
    apply_penalties(
        got,
        padded(prompts),
        padded(outputs),
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )
    torch.testing.assert_close(got, torch.tensor(expected))


def test_penalties_with_no_output_yet_touch_only_prompt_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(
        logits,
        torch.tensor([[0, 1]]),
        torch.zeros(1, 0, dtype=torch.long),
        torch.tensor([2.0]),
        torch.tensor([2.0]),
        torch.tensor([2.0]),
    )
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def sample(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]], n_prompt: int
):
    sampler = Sampler(torch.device("cpu"))
    return sampler(logits, params, [None] * len(params), token_ids, [n_prompt] * len(params))


def test_sampler_penalizes_only_rows_that_ask_and_reports_model_logprobs() -> None:
    # Row-wise the same logits: token 0 leads by 1.0, token 1 is second.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    history = [[4, 0], [4, 0], [4, 0]]  # prompt [4], output so far [0]
    params = [
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0, presence_penalty=1.5, logprobs=1),
        SamplingParams(temperature=0.0, frequency_penalty=0.0, presence_penalty=0.0),
    ]
    out = sample(logits.clone(), params, history, 1)
    assert out.token_ids == [0, 1, 0]
    model_logprobs = logits[0].log_softmax(-1)
    assert out.logprobs[1][0] == pytest.approx(model_logprobs[1].item())
    assert out.logprobs[0][0] == pytest.approx(model_logprobs[0].item())


def test_sampler_does_no_penalty_work_when_no_row_asks(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("penalty work on a batch without penalties")

    monkeypatch.setattr(sampler_mod, "apply_penalties", refuse)
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0),
    ]
    out = sample(logits, params, [[1, 2, 3]] * 3, 2)
    assert out.token_ids[0] == logits[0].argmax().item()


# ---- end to end ---------------------------------------------------------------------------
TINY_PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that",
    "Once upon a time, in a land far away, there lived a",
]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **kw)


def output_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_neutral_penalties_give_plain_greedy_tokens() -> None:
    llm = LLM(model="tiny-llama", num_kv_blocks=64)
    plain = output_ids(llm, TINY_PROMPTS, greedy())
    neutral = greedy(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    assert output_ids(llm, TINY_PROMPTS, neutral) == plain
    # A penalized neighbour in the batch leaves the other rows as they were.
    mixed = [greedy(), greedy(repetition_penalty=1.5, presence_penalty=2.0), greedy()]
    got = output_ids(llm, TINY_PROMPTS, mixed)
    assert [got[0], got[2]] == [plain[0], plain[2]]


# tiny-llama's random weights almost never repeat a token in 32, so there is nothing for a
# penalty to change; smollm2-135m-instruct's greedy output loops, as small real models do.
REAL_MODEL = "smollm2-135m-instruct"
REAL_PROMPTS = [
    "1 2 3 4 5 6 7 8 9 10",
    "Hello, my name is",
    "Les montagnes de Suisse sont",
    "The history of the Roman Empire began",
]
REPETITION_PENALTY = 1.3


def num_repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


@pytest.fixture(scope="module")
def real_llm() -> LLM:
    return LLM(model=REAL_MODEL, num_kv_blocks=64, dtype="float32", quantization=None)


@pytest.fixture(scope="module")
def plain_greedy(real_llm: LLM) -> list[list[int]]:
    return output_ids(real_llm, REAL_PROMPTS, greedy())


@pytest.mark.slow
@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.3}],
    ids=["presence", "frequency", "repetition"],
)
def test_penalties_make_greedy_output_repeat_less(
    real_llm: LLM, plain_greedy: list[list[int]], penalty: dict
) -> None:
    plain = plain_greedy
    penalized = output_ids(real_llm, REAL_PROMPTS, greedy(**penalty))
    assert penalized != plain
    before, after = sum(map(num_repeats, plain)), sum(map(num_repeats, penalized))
    assert after < before / 2, (before, after)


@pytest.fixture(scope="module")
def repetition_references(real_llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids, and transformers' greedy tokens with its own repetition penalty."""
    from transformers import AutoModelForCausalLM

    from stepscope.engine.models.loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(REAL_MODEL), dtype=torch.float32
    ).eval()
    prompts = [real_llm.tokenizer.encode(p) for p in REAL_PROMPTS]
    references = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=32,
                do_sample=False,
                repetition_penalty=REPETITION_PENALTY,
            )
            references.append(out[0, len(p) :].tolist())
    return prompts, references


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param(None, id="one-batch"),
        pytest.param({"max_num_batched_tokens": 4}, id="chunked-prefill-4"),
        # 5 blocks of 16 tokens: each request needs 3, so they preempt one another.
        pytest.param({"num_kv_blocks": 5}, id="preemption"),
    ],
)
def test_penalized_tokens_equal_references_under_chunking_and_preemption(
    real_llm: LLM, repetition_references, engine_args: dict | None
) -> None:
    """Repetition penalty against transformers; presence and frequency penalties (which count
    only output tokens, so a recomputed request must not take its output for prompt) against
    one batch of a roomy engine."""
    prompts, references = repetition_references
    if engine_args is None:
        llm = real_llm
    else:
        llm = LLM(model=REAL_MODEL, dtype="float32", quantization=None, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=REPETITION_PENALTY)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references
    if engine_args is None:
        return
    output_penalties = greedy(presence_penalty=1.0, frequency_penalty=0.5)
    assert output_ids(llm, prompts, output_penalties) == output_ids(
        real_llm, prompts, output_penalties
    )
    if "num_kv_blocks" in engine_args:
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
