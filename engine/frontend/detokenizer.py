"""Incremental detokenizer: token ids become text in the API process (stage 10; see
docs/request-path.md).

The engine core sends back token ids only. Here each request's ids become text a step at a time;
stop strings are found (the caller then aborts the request in the engine core, finish_reason
'stop') and, until the request finishes, the last characters a stop string could still be forming
across tokens are held back, so a client is never sent text that must later be taken back.

Decoding goes through `tokenizers.decoders.DecodeStream`: per token it re-decodes only a short
window, in Rust, and returns None while the bytes of a multibyte character (CJK, emoji split over
byte-level tokens) are incomplete, so no delta carries a U+FFFD for them. The stream is primed with
the prompt's last tokens so that decoders which drop the space of a sequence's first token
(SentencePiece's ▁) keep the first output token's space, as vLLM does. For byte-level BPE such as
SmolLM2's that priming changes nothing: with no stop string, `output_text` equals
`tokenizer.decode(output_token_ids, skip_special_tokens=...)`, including the bytes of an incomplete
character the stream still holds when the request finishes.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from stepscope.engine.sampling_params import SamplingParams

# Tokens decoded ahead of new ones so that these decode as they would in the whole sequence.
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text, built from its output token ids as they arrive."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # A transformers fast tokenizer wraps a `tokenizers.Tokenizer`; a bare one is taken as is.
        self._tokenizer: Tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._hold_back = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the request, if any
        self._finished = False
        # Prompt tokens ending inside a character would make the stream emit their own text.
        self._prompt_tail = self._clean_context(prompt_token_ids[-CONTEXT_TOKENS:])
        self._stream = DecodeStream(
            self._prompt_tail, skip_special_tokens=self._skip_special_tokens
        )
        self._held_from = 0  # token_ids[_held_from:] are in the stream but not yet in the text
        # The text as parts, so that a step appends in O(new text): `_sent` was returned as
        # deltas, `_unsent` was not (until the end it holds at least the held-back characters).
        self._sent: list[str] = []
        self._unsent: list[str] = []

    @property
    def output_text(self) -> str:
        """The whole text so far, stop string removed unless include_stop_str_in_output."""
        return "".join(self._sent) + "".join(self._unsent)

    def update(
        self, new_token_ids: list[int], finished: bool, stop_token: bool = False
    ) -> str | None:
        """Feed this step's new token ids; `finished` when the engine core ended the request.
        `stop_token`: the last of them is the eos or stop token id that ended it; as in vLLM,
        its text is not part of the output unless include_stop_str_in_output.

        Returns the stop string that matched (the request must then be aborted in the engine core
        and finish with reason 'stop'), else None. Tokens after the match are dropped, and so is
        any update after the request finished.
        """
        if self._finished:
            return None
        hidden = new_token_ids[-1:] if stop_token and not self._include_stop else []
        if hidden:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            text = self._step(token_id)
            if text:
                self._held_from = len(self.token_ids)
                if self._append(text):
                    return self.stop_reason
        if finished:
            self._finished = True
            # An incomplete character at the very end: decode it as a full decode would (U+FFFD).
            if self._held_from < len(self.token_ids):
                text = self._decode_held()
                self._held_from = len(self.token_ids)
                if text and self._append(text):
                    return self.stop_reason
        self.token_ids += hidden  # counted as an output token, never decoded
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """delta=True: the text produced since the last delta call (streaming); delta=False: the
        whole text so far. While not finished, the last max(len(stop)) - 1 characters are held
        back, as a stop string could still be forming across tokens; once finished (or a stop
        string matched), everything is released."""
        hold_back = 0 if finished or self._finished else self._hold_back
        unsent = "".join(self._unsent)
        ready = len(unsent) - hold_back
        if not delta:
            return "".join(self._sent) + unsent[: max(ready, 0)]
        if ready <= 0:
            return ""
        self._sent.append(unsent[:ready])
        self._unsent = [unsent[ready:]] if hold_back else []
        return unsent[:ready]

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception:
            # tokenizers raises "Invalid prefix encountered" when a decoder rewrites text it
            # already returned. Restart the stream at the last point the text was whole and
            # replay the tokens it held.
            self._stream = DecodeStream(
                self._context_before_held(), skip_special_tokens=self._skip_special_tokens
            )
            return self._stream.step(self._tokenizer, self.token_ids[self._held_from :])

    def _append(self, text: str) -> bool:
        """Add newly decoded text; True when it completes a stop string (the text is then cut)."""
        if not self._stop:
            self._push(text)
            return False
        # Earlier text held no stop string, so a match ends in `text` and starts at most
        # max(len(stop)) - 1 characters before it.
        tail = self._tail(self._hold_back)
        window = tail + text
        match = _earliest_stop(window, self._stop)
        if match is None:
            self._push(text)
            return False
        index, stop = match
        end = index + len(stop) if self._include_stop else index
        if end >= len(tail):
            self._push(window[len(tail) : end])
        else:  # The match began in text already added: take that back (it was never sent).
            self._drop_last(len(tail) - end)
        self.stop_reason = stop
        self._finished = True
        return True

    def _push(self, text: str) -> None:
        if text:
            self._unsent.append(text)

    def _tail(self, n: int) -> str:
        """The last n characters of the text; O(n) since every part is non-empty."""
        parts: list[str] = []
        for part in chain(reversed(self._unsent), reversed(self._sent)):
            if n <= 0:
                break
            parts.append(part[-n:])
            n -= len(part)
        return "".join(reversed(parts))

    def _drop_last(self, n: int) -> None:
        """Remove the last n characters; they are unsent, as a match starts at most
        max(len(stop)) - 1 characters before the new text and those are held back."""
        unsent = "".join(self._unsent)
        self._unsent = [unsent[:-n]] if n < len(unsent) else []

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _clean_context(self, token_ids: list[int]) -> list[int]:
        """Shorten token_ids from the end until they decode to whole characters."""
        while token_ids and self._decode(token_ids).endswith(REPLACEMENT_CHAR):
            token_ids = token_ids[:-1]
        return token_ids

    def _context_before_held(self) -> list[int]:
        """The last tokens before the held ones (from the prompt's last tokens if the output is
        short)."""
        start = max(self._held_from - CONTEXT_TOKENS, 0)
        context = (self._prompt_tail + self.token_ids[start : self._held_from])[-CONTEXT_TOKENS:]
        return self._clean_context(context)

    def _decode_held(self) -> str:
        """The text of the tokens the stream still holds, decoded after their context."""
        context = self._context_before_held()
        prefix = self._decode(context)
        text = self._decode(context + self.token_ids[self._held_from :])
        return text[len(prefix) :] if text.startswith(prefix) else text


def _earliest_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string found earliest in text (the first listed on a tie), and its index."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
