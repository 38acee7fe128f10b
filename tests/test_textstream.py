"""Incremental text (textstream.py): the pieces join to the full decode, no U+FFFD is sent for a
character still being completed, and stop strings matched over the tail window cut where
matching over the whole text does (the engine's check before it became incremental)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode.runtime.textstream import REPLACEMENT_CHAR, IncrementalDecoder, TextStream

from conftest import char_tokenizer

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class ByteTokenizer:
    """Each id is one UTF-8 byte: every multi-byte character spans several tokens."""

    def __len__(self) -> int:
        return 256

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


CHAR = char_tokenizer("é😀")  # the two extra characters are one token each
BYTES = ByteTokenizer()


def full_decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@st.composite
def steps(draw, tokenizer, max_ids: int = 60):
    """Random ids split into random steps: either any ids of the vocabulary, or the ids of some
    text (characters spanning several tokens, cut anywhere)."""
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=max_ids))
    else:
        text = draw(st.text(st.characters(codec="utf-8"), max_size=max_ids // 3))
        ids = tokenizer.encode(text, add_special_tokens=False)[:max_ids]
        if ids and draw(st.booleans()):  # end in the middle of the last character
            ids = ids[: draw(st.integers(0, len(ids) - 1))]
    blocks, i = [], 0
    while i < len(ids):
        n = draw(st.integers(1, 5))
        blocks.append(ids[i : i + n])
        i += n
    return blocks


def check_decoder(tokenizer, blocks) -> None:
    decoder = IncrementalDecoder(tokenizer)
    pieces = []
    for block in blocks:
        piece = decoder.push(block)
        assert not piece.endswith(REPLACEMENT_CHAR)  # never sent for an unfinished character
        pieces.append(piece)
    pieces.append(decoder.flush())
    ids = [t for block in blocks for t in block]
    assert "".join(pieces) == full_decode(tokenizer, ids)


def reference_stop(tokenizer, blocks, stops) -> tuple[list[int], str, bool]:
    """The engine's stop check before textstream.py: decode everything after every step, then
    every prefix of the block where a stop string appeared; the text cut as `generate` cuts."""
    ids: list[int] = []
    for block in blocks:
        before = len(ids)
        ids = ids + block
        if any(s in full_decode(tokenizer, ids) for s in stops):
            n = next(
                (
                    n
                    for n in range(1, len(block) + 1)
                    if any(s in full_decode(tokenizer, ids[: before + n]) for s in stops)
                ),
                len(block),
            )
            ids = ids[: before + n]
            text = full_decode(tokenizer, ids)
            return ids, text[: min(text.find(s) for s in stops if s in text)], True
    return ids, full_decode(tokenizer, ids), False


def check_stops(tokenizer, blocks, stops) -> None:
    expected_ids, expected_text, expected_stop = reference_stop(tokenizer, blocks, stops)
    text = TextStream(tokenizer, stops)
    sent, kept = [], []
    for block in blocks:
        kept.extend(text.feed(block))
        piece = text.take()
        sent.append(piece)
        if text.stopped:
            break
    sent.append(text.finish())
    assert kept == expected_ids == text.ids
    assert text.stopped == expected_stop
    assert text.final_text == expected_text
    assert "".join(sent) == expected_text  # nothing past the stop string was ever sent


@st.composite
def stop_case(draw, tokenizer):
    """Steps and up to 4 stop strings, most of them taken from the decoded text so they hit."""
    blocks = draw(steps(tokenizer))
    text = full_decode(tokenizer, [t for block in blocks for t in block])
    stops = []
    for _ in range(draw(st.integers(1, 4))):
        if text and draw(st.integers(0, 3)):
            i = draw(st.integers(0, len(text) - 1))
            stops.append(text[i : i + draw(st.integers(1, 6))])
        else:
            stops.append(draw(st.text(min_size=1, max_size=4)))
    return blocks, stops


# -- the tiny tokenizers of the tests ---------------------------------------------------------


@FAST
@given(steps(CHAR))
def test_char_tokenizer_pieces_join_to_the_full_decode(blocks):
    check_decoder(CHAR, blocks)


@FAST
@given(steps(BYTES))
def test_byte_tokenizer_pieces_join_to_the_full_decode(blocks):
    check_decoder(BYTES, blocks)


@FAST
@given(stop_case(CHAR))
def test_char_tokenizer_tail_window_stops_cut_as_the_whole_text_does(case):
    check_stops(CHAR, *case)


@FAST
@given(stop_case(BYTES))
def test_byte_tokenizer_tail_window_stops_cut_as_the_whole_text_does(case):
    check_stops(BYTES, *case)


def test_a_character_split_across_steps_is_sent_once_complete():
    text = TextStream(BYTES)
    emoji = "😀".encode()  # four bytes, four steps
    for b in emoji[:-1]:
        text.feed([b])
        assert text.take() == ""
    text.feed(emoji[-1:])
    assert text.take() == "😀"
    text.feed(emoji[:2])  # cut off mid-character: the full decode keeps U+FFFD, and so do we
    assert text.take() == "" and text.finish() == REPLACEMENT_CHAR


def test_the_window_stays_small():
    """Each step decodes the last settled piece and the new ids, not the whole output."""
    calls = []

    class Counting(ByteTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return super().decode(ids)

    text = TextStream(Counting(), stops=["never"])
    for b in ("abc é " * 200).encode():
        text.feed([b])
        text.take()
    assert max(calls) <= 4  # a two-byte character and the piece before it


# -- SmolLM2's tokenizer (byte-level BPE, 49152 tokens) ---------------------------------------


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from specdecode.models.fetch import fetch_preset

    return AutoTokenizer.from_pretrained(fetch_preset("smollm2-135m-instruct"))


@pytest.mark.real_model
def test_smollm2_pieces_join_to_the_full_decode(smollm_tokenizer):
    @settings(max_examples=200, deadline=None)
    @given(steps(smollm_tokenizer))
    def check(blocks):
        check_decoder(smollm_tokenizer, blocks)

    check()


@pytest.mark.real_model
def test_smollm2_tail_window_stops_cut_as_the_whole_text_does(smollm_tokenizer):
    @settings(max_examples=150, deadline=None)
    @given(stop_case(smollm_tokenizer))
    def check(case):
        check_stops(smollm_tokenizer, *case)

    check()
