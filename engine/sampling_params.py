"""Sampling parameters: what the user asks of one request, validated at the edge (stage 1)."""

from __future__ import annotations

import json
import math
import re

import msgspec

# Largest `n` and `logprobs` a request may ask for; beyond this a request is refused, not truncated.
MAX_N = 16
MAX_LOGPROBS = 20
# OpenAI's range for a logit bias.
MAX_LOGIT_BIAS = 100.0
# OpenAI's range for presence_penalty and frequency_penalty.
MAX_PENALTY = 2.0
_INT64 = (-(2**63), 2**63 - 1)


class FieldError(ValueError):
    """Bad user input that names the request field it refuses (`param`, a dotted path such as
    `stop.1`): the server answers it with a 400 whose `param` is that field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the output must match, exactly one of: a JSON schema (`json`, its text), any JSON
    object (`json_object`), a regular expression, one of a list of strings (`choice`), or an EBNF
    grammar. vLLM's `StructuredOutputsParams` under the same names. The engine core compiles it
    (engine/core/structured_output.py) and the worker masks the logits with it."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise FieldError(
                "structured_outputs",
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}",
            )
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise FieldError("structured_outputs.choice", "choice must be non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: `json`, `json_object`, `regex`, `choice` or `grammar`."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def check(self) -> None:
        """Raise FieldError (`param` structured_outputs.<kind>) for a grammar that cannot be
        built: a JSON schema that is not JSON, or a schema, regex or EBNF grammar that xgrammar
        refuses. Cheap (no tokenizer, a few ms for a schema of thousands of properties), so the
        front end runs it and only what the compile against the vocabulary finds reaches the
        engine core."""
        kind = self.kind
        if kind in ("json_object", "choice"):
            return
        import xgrammar as xgr

        param = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                schema = json_schema_for_xgrammar(self.json)
                xgr.Grammar.from_json_schema(schema, any_whitespace=False)
            elif kind == "regex":
                xgr.Grammar.from_regex(self.regex)
            else:
                xgr.Grammar.from_ebnf(self.grammar)
        except RuntimeError as e:
            raise FieldError(param, f"invalid {kind}: {grammar_error(e)}") from None
        except UnicodeDecodeError:
            # xgrammar quotes the text near the error and may cut it inside a UTF-8 character,
            # and then its message itself cannot be read (a grammar of non-ASCII text).
            raise FieldError(
                param, f"invalid {kind}: xgrammar refused it (its message could not be decoded)"
            ) from None


_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")
# A JSON string of `minLength`-`maxLength` characters, none of them a control character, a quote
# or a backslash (no escapes): what a length-bounded string compiles to (json_schema_for_xgrammar).
_BOUNDED_STRING = '^[^\\x00-\\x1f"\\\\]{%d,%s}$'


def json_schema_for_xgrammar(text: str) -> str:
    """The schema text xgrammar compiles: `text` with each length-bounded string rewritten as a
    pattern. xgrammar 0.2.8 compiles `minLength`/`maxLength` into a string that admits raw
    control characters, which JSON forbids, and no escapes (its issue #800), so a bounded string
    could end a request with `stop` and text `json.loads` refuses; a pattern of plain characters
    has neither fault. A bounded string that also has a `pattern` or `format` cannot be
    rewritten, and is refused (FieldError), as is text that is not JSON."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise FieldError(
            "structured_outputs.json", f"the JSON schema is not valid JSON: {e}"
        ) from None
    return json.dumps(_bounded_strings_as_patterns(schema))


def _bounded_strings_as_patterns(node: object) -> object:
    if isinstance(node, list):
        return [_bounded_strings_as_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _bounded_strings_as_patterns(value) for key, value in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") != "string" or not bounded or "enum" in node or "const" in node:
        return node
    if "pattern" in node or "format" in node:
        raise FieldError(
            "structured_outputs.json",
            "a string with minLength or maxLength and also a pattern or format is not supported",
        )
    low, high = node.pop("minLength", 0), node.pop("maxLength", None)
    if not isinstance(low, int) or not isinstance(high, int | None):
        raise FieldError("structured_outputs.json", "minLength and maxLength must be integers")
    node["pattern"] = _BOUNDED_STRING % (low, "" if high is None else high)
    return node


# xgrammar's messages open with a time and its C++ source line: "[08:30:57] /project/cpp/x.cc:83: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


def grammar_error(error: BaseException) -> str:
    """xgrammar's error message, without its time and C++ source line."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return _XGRAMMAR_PREFIX.sub("", lines[0] if lines else type(error).__name__)


# Temperatures below this sample as greedy (vLLM's `_SAMPLING_EPS`).
SAMPLING_EPS = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop. A msgspec struct so it crosses processes as is.

    temperature 0 (anything below SAMPLING_EPS) means greedy. `seed` makes sampling reproducible
    per request, whatever else is in the batch. `stop` strings are checked by the detokenizer;
    the rest by the scheduler.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt's own tokens (each given the ones before it), with the top-N at
    # each position: what `echo` with `logprobs` returns, and what loglikelihood evals read.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's `logit_bias`).
    logit_bias: dict[int, float] | None = None
    # OpenAI's presence and frequency penalties (over output tokens) and vLLM's repetition
    # penalty (over prompt and output tokens), applied by the worker's sampler.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # A grammar the output must follow (JSON schema, regex, choice, EBNF); None for free text.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise FieldError(name, f"{name} must be a finite number, got {getattr(self, name)}")
        for name in (
            "n",
            "top_k",
            "seed",
            "max_tokens",
            "min_tokens",
            "logprobs",
            "prompt_logprobs",
        ):
            value = getattr(self, name)
            if value is not None and not _INT64[0] <= value <= _INT64[1]:
                raise FieldError(name, f"{name} must fit in a 64-bit integer, got {value}")
        if any(not _INT64[0] <= t <= _INT64[1] for t in self.stop_token_ids):
            raise FieldError("stop_token_ids", "stop_token_ids must be token ids of the vocabulary")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                    raise FieldError(
                        "logit_bias",
                        f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                        f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token}",
                    )
                if not 0 <= token <= _INT64[1]:
                    raise FieldError(
                        "logit_bias", f"logit_bias keys must be token ids, got {token}"
                    )
        if not 1 <= self.n <= MAX_N:
            raise FieldError("n", f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.temperature < 0:
            raise FieldError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FieldError("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise FieldError(
                    name,
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                    f"got {getattr(self, name)}",
                )
        if self.repetition_penalty <= 0:
            raise FieldError(
                "repetition_penalty",
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}",
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise FieldError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise FieldError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise FieldError(
                "logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise FieldError(
                "prompt_logprobs",
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
            )
        if any(not s for s in self.stop):
            raise FieldError("stop", "stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise FieldError("stop_token_ids", "stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        # As vLLM's _SAMPLING_EPS: a temperature this small is greedy in all but float noise,
        # and one below float32's range (1e-65) would divide the logits by zero.
        return self.temperature < SAMPLING_EPS
