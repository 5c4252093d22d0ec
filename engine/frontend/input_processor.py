"""Input processing in the API process: prompt to token ids, validated (stages 1 and 2).

Bad input raises `FieldError` (a ValueError naming the request field it refuses) here, at the
edge, so it never reaches the engine core's busy loop; a server answers it with a 400 that names
the field.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from stepscope.engine.messages import EngineCoreRequest
from stepscope.engine.sampling_params import FieldError, SamplingParams

PromptType = str | list[int]
# The generation_config.json keys that become default sampling values, as vLLM takes them.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")


class InputProcessor:
    """`generation_config`: the checkpoint's generation_config.json. Its sampling values are the
    defaults of a request that leaves them unset (`default_sampling`), and every eos id it lists
    stops a request as the tokenizer's own eos does."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        generation_config: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = tokenizer.eos_token_id
        gen = generation_config or {}
        self.default_sampling: dict[str, Any] = {
            k: gen[k] for k in GENERATION_DEFAULTS if gen.get(k) is not None
        }
        eos = gen.get("eos_token_id")
        eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        # The tokenizer's eos stays the request's eos; the others are stop token ids, hidden
        # from the text like it (vLLM's update_from_generation_config).
        self.extra_eos_ids = sorted(eos_ids - {self.eos_token_id})

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's defaults (vLLM's get_default_sampling_params)."""
        return SamplingParams(**self.default_sampling)

    def tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise FieldError(
                    "prompt", f"the prompt is not valid Unicode text: {e.reason}"
                ) from None
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise FieldError("prompt", "a prompt must be a string or a list of token ids")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise FieldError(
                "messages", "messages must be a list of {'role': ..., 'content': ...} dicts"
            )
        if not self.tokenizer.chat_template:  # a base model's checkpoint may ship none
            raise FieldError(
                "messages", "this model's checkpoint has no chat template: send a plain prompt"
            )
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> EngineCoreRequest:
        """The validated request. `arrival_time` is when the caller got the prompt, before it
        was tokenized (now, if not given): the request span starts there, so stage 1 covers
        tokenizing."""
        self.validate_prompt(prompt_token_ids)
        self.validate_max_tokens(prompt_token_ids, params)
        self.validate_token_ids(params)
        self.validate_stop(params)
        if params.structured_outputs is not None:
            params.structured_outputs.check()
        if self.extra_eos_ids and not params.ignore_eos:
            stop_ids = sorted(set(params.stop_token_ids) | set(self.extra_eos_ids))
            params = msgspec.structs.replace(params, stop_token_ids=stop_ids)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
        )

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise FieldError unless the prompt is non-empty, in the vocabulary and shorter than
        the context."""
        if not prompt_token_ids:
            raise FieldError("prompt", "the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in prompt_token_ids):
            raise FieldError("prompt", f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise FieldError(
                "prompt",
                f"the prompt has {len(prompt_token_ids)} tokens, but the model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate",
            )

    def validate_max_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise FieldError when the prompt plus `max_tokens` cannot fit in the context (which
        the engine core has fitted to the KV cache): such a request could never finish."""
        if params.max_tokens is None:
            return  # generate until the context is full
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise FieldError(
                "max_tokens",
                f"max_tokens ({params.max_tokens}) plus the prompt ({len(prompt_token_ids)} "
                f"tokens) exceeds the context of {self.max_model_len} tokens; ask for at most "
                f"{self.max_model_len - len(prompt_token_ids)} tokens",
            )

    def validate_token_ids(self, params: SamplingParams) -> None:
        """Raise FieldError for `stop_token_ids` or `logit_bias` ids outside the vocabulary."""
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
        ):
            bad = sorted(t for t in ids if not 0 <= t < self.vocab_size)
            if bad:
                raise FieldError(
                    name,
                    f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): "
                    f"{', '.join(map(str, bad[:5]))}",
                )

    def validate_stop(self, params: SamplingParams) -> None:
        """Raise FieldError for a stop string longer than the context: it could never match."""
        for i, stop in enumerate(params.stop):
            # A string has at most one token per UTF-8 byte, plus a leading-space marker some
            # tokenizers add, so the common short stop string need not be tokenized.
            if len(stop.encode("utf-8")) < self.max_model_len:
                continue
            num_tokens = len(self.tokenizer.encode(stop, add_special_tokens=False))
            if num_tokens > self.max_model_len:
                raise FieldError(
                    "stop",
                    f"stop string {i} is {num_tokens} tokens long, longer than the model's "
                    f"context of {self.max_model_len} tokens, so it could never match",
                )
