"""The incremental detokenizer (stage 9) against the real SmolLM2 tokenizer: deltas add up to the
full decode, never split a character, never show text a stop string takes back."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepscope.engine.frontend.detokenizer import IncrementalDetokenizer
from stepscope.engine.sampling_params import SamplingParams

ENGLISH = "The quick brown fox jumps over the lazy dog, twice."
CJK = "東京は日本の首都です。"
EMOJI = "🌊🎉👍🏽"
MIXED = "Mixed: naïve café, 東京 🌊 and 👍🏽 done!"
IM_END = 2  # SmolLM2's <|im_end|>, a special token


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(
    tok: Any,
    ids: list[int],
    params: SamplingParams,
    chunk: int = 1,
    prompt: list[int] | None = None,
) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    """Feed ids `chunk` at a time as the API process does; return deltas, detokenizer, stop."""
    detok = IncrementalDetokenizer(tok, prompt or [], params)
    deltas: list[str] = []
    stop = None
    for start in range(0, max(len(ids), 1), chunk):
        last = start + chunk >= len(ids)
        stop = detok.update(ids[start : start + chunk], finished=last)
        deltas.append(detok.get_next_output_text(finished=last or stop is not None, delta=True))
        if stop is not None:
            break
    return deltas, detok, stop


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("text", [ENGLISH, CJK, EMOJI, MIXED])
def test_deltas_concatenate_to_full_decode_without_replacement_chars(
    tok: Any, text: str, chunk: int
) -> None:
    ids = encode(tok, text)
    deltas, detok, stop = stream(tok, ids, SamplingParams(), chunk=chunk)
    assert stop is None
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.token_ids == ids


def test_multibyte_characters_really_span_tokens(tok: Any) -> None:
    # Guards the tests above: CJK and emoji must be split into byte-level pieces.
    for text in (CJK, EMOJI):
        assert any(tok.decode([i]).endswith("\ufffd") for i in encode(tok, text))


def test_incomplete_character_is_held_until_its_last_byte(tok: Any) -> None:
    ids = encode(tok, EMOJI)[:3]  # 🌊 is one token of the first bytes plus two more
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for i in ids[:-1]:
        detok.update([i], finished=False)
        assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update(ids[-1:], finished=False)
    assert detok.get_next_output_text(finished=False, delta=True) == "🌊"


def test_incomplete_character_at_the_end_decodes_as_a_full_decode(tok: Any) -> None:
    ids = encode(tok, "ok " + EMOJI)[:-1]  # the last emoji's final byte never arrives
    deltas, detok, _ = stream(tok, ids, SamplingParams())
    assert "".join(deltas) == detok.output_text == tok.decode(ids)
    assert detok.output_text.endswith("\ufffd")


def test_prompt_context_leaves_output_text_equal_to_decoding_output_ids(tok: Any) -> None:
    prompt = encode(tok, "<|im_start|>user\nWhere is Tokyo? 東")[:-1]  # ends inside a character
    ids = encode(tok, " Tokyo is in Japan: 東京")
    deltas, detok, _ = stream(tok, ids, SamplingParams(), prompt=prompt)
    assert "".join(deltas) == detok.output_text == tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_respected(tok: Any, skip: bool) -> None:
    ids = encode(tok, "Hi there") + [IM_END] + encode(tok, " after")
    deltas, detok, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


def test_stop_string_forming_across_tokens_is_never_streamed(tok: Any) -> None:
    head, tail = encode(tok, "Hello ST"), encode(tok, "OP world")
    assert tok.decode(tail[:1]).startswith("OP")  # "STOP" really spans two tokens
    deltas, detok, stop = stream(tok, head + tail, SamplingParams(stop=["STOP"]))
    assert stop == "STOP"
    assert not any("ST" in d for d in deltas)
    assert "".join(deltas) == detok.output_text == "Hello "
    assert detok.token_ids == head + tail[:1]


def test_stop_string_kept_when_include_stop_str_in_output(tok: Any) -> None:
    ids = encode(tok, "Hello ST") + encode(tok, "OP world")
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    deltas, detok, stop = stream(tok, ids, params)
    assert stop == "STOP"
    assert "".join(deltas) == detok.output_text == "Hello STOP"


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_text_after_stop_string_is_never_emitted(tok: Any, chunk: int) -> None:
    ids = encode(tok, "one two three four five six")
    deltas, detok, stop = stream(tok, ids, SamplingParams(stop=["three"]), chunk=chunk)
    assert stop == "three"
    assert "".join(deltas) == detok.output_text == "one two "
    assert tok.decode(detok.token_ids) == "one two three"  # ids after the match are dropped
    assert detok.update(encode(tok, " seven"), finished=True) is None
    assert detok.output_text == "one two "


def test_first_completed_stop_string_wins(tok: Any) -> None:
    ids = encode(tok, "alpha beta gamma delta")
    deltas, detok, stop = stream(tok, ids, SamplingParams(stop=["delta", "beta"]), chunk=100)
    assert stop == "beta"
    assert "".join(deltas) == detok.output_text == "alpha "


def test_earliest_starting_stop_string_wins_when_several_complete_in_one_token(tok: Any) -> None:
    ids = encode(tok, "the lazy dog barks")
    deltas, detok, stop = stream(tok, ids, SamplingParams(stop=["dog", "lazy dog"]))
    assert stop == "lazy dog"
    assert "".join(deltas) == detok.output_text == "the "


def test_stop_string_inside_multibyte_text(tok: Any) -> None:
    ids = encode(tok, CJK)
    deltas, detok, stop = stream(tok, ids, SamplingParams(stop=["首都"]))
    assert stop == "首都"
    assert "".join(deltas) == detok.output_text == "東京は日本の"


def test_held_back_text_released_when_finished(tok: Any) -> None:
    ids = encode(tok, "no stop here")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["XYZ"]))
    detok.update(ids, finished=False)
    assert detok.get_next_output_text(finished=False, delta=False) == "no stop he"
    assert detok.get_next_output_text(finished=False, delta=True) == "no stop he"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update([], finished=True)
    assert detok.get_next_output_text(finished=True, delta=True) == "re"
    assert detok.get_next_output_text(finished=True, delta=False) == "no stop here"


class FailingOnce:
    """A DecodeStream that fails its next step as tokenizers does on an invalid prefix."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.failed = False

    def step(self, tokenizer: Any, token_id: int | list[int]) -> str | None:
        if not self.failed:
            self.failed = True
            raise Exception("Invalid prefix encountered")
        return self.real.step(tokenizer, token_id)


def test_stream_restarts_after_invalid_prefix_error(tok: Any) -> None:
    ids = encode(tok, "Hi " + CJK)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(ids[:3], finished=False)  # ends inside 東: the stream holds a token
    assert detok._held_from < len(detok.token_ids)
    detok._stream = FailingOnce(detok._stream)
    detok.update(ids[3:], finished=True)
    assert detok.output_text == "Hi " + CJK


# Token ids as a model may produce them: pieces of real text (multibyte characters split over
# byte-level tokens), arbitrary ids of the vocabulary, and special tokens.
VOCAB_SIZE = 49152
token_pieces = st.one_of(
    st.text(max_size=8),
    st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=4),
    st.lists(st.sampled_from([0, 1, IM_END]), min_size=1, max_size=2),
)


@st.composite
def token_ids(draw: st.DrawFn, tok: Any) -> list[int]:
    ids: list[int] = []
    for piece in draw(st.lists(token_pieces, max_size=6)):
        ids += encode(tok, piece) if isinstance(piece, str) else piece
    return ids


@settings(max_examples=100, deadline=None)
@given(data=st.data(), chunk=st.integers(1, 5), skip=st.booleans())
def test_random_ids_stream_to_the_full_decode(
    tok: Any, data: st.DataObject, chunk: int, skip: bool
) -> None:
    ids = data.draw(token_ids(tok))
    prompt = data.draw(token_ids(tok))
    params = SamplingParams(skip_special_tokens=skip)
    deltas, detok, stop = stream(tok, ids, params, chunk=chunk, prompt=prompt)
    assert stop is None
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=skip)


def expected_stop(
    tok: Any, ids: list[int], params: SamplingParams
) -> tuple[str, list[int], str | None]:
    """Reference: the text after each token alone, then the first token whose text completes a
    stop string, cut at the earliest-starting one."""
    detok = IncrementalDetokenizer(
        tok, [], SamplingParams(skip_special_tokens=params.skip_special_tokens)
    )
    for k, token_id in enumerate(ids):
        detok.update([token_id], finished=k == len(ids) - 1)
        text = detok.output_text
        found = [(text.find(s), i, s) for i, s in enumerate(params.stop) if s in text]
        if found:
            index, _, stop = min(found)
            end = index + len(stop) if params.include_stop_str_in_output else index
            return text[:end], ids[: k + 1], stop
    return detok.output_text, ids, None


@settings(max_examples=100, deadline=None)
@given(data=st.data(), chunk=st.integers(1, 5), include=st.booleans())
def test_random_stop_strings_cut_text_and_never_stream_past_it(
    tok: Any, data: st.DataObject, chunk: int, include: bool
) -> None:
    ids = data.draw(token_ids(tok))
    text = tok.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if text and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(text) - 1))
            stops.append(text[start : data.draw(st.integers(start + 1, len(text)))])
        else:
            stops.append(data.draw(st.text(min_size=1, max_size=3)))
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)

    deltas, detok, stop = stream(tok, ids, params, chunk=chunk)

    assert (detok.output_text, detok.token_ids, stop) == expected_stop(tok, ids, params)
    assert "".join(deltas) == detok.output_text
    body = detok.output_text[: -len(stop)] if include and stop else detok.output_text
    assert not any(s in body for s in stops)
