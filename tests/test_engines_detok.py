"""Incremental detokenization (``sart.engines.detok``): at every length, the text of
the tokens so far is what decoding them all at once gives, while decoding only a tail."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from sart.engines.detok import Detok


def _bytes_decode(ids: Sequence[int]) -> str:
    """A byte-level tokenizer: a multi-byte character cut between tokens decodes to U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


PIECES = ["\u2581the", "\u2581cat", "s", "\u2581", "!", "\u2581sat", "at"]


def _metaspace_decode(ids: Sequence[int]) -> str:
    """A SentencePiece-like tokenizer: ``\u2581`` is a space, dropped at the start of a
    string, so a token decodes differently at the start than after others."""
    return "".join(PIECES[i] for i in ids).replace("\u2581", " ").removeprefix(" ")


def _check(decode, ids: list[int]) -> int:
    """Decode ``ids`` one more token at a time; returns the longest window decoded."""
    state, widest = Detok(), 0
    calls: list[int] = []

    def counted(window: Sequence[int]) -> str:
        calls.append(len(window))
        return decode(window)

    for count in range(1, len(ids) + 1):
        text, state = state.text(counted, ids, count)
        assert text == decode(ids[:count]), count
        widest = max([widest, *calls])
        calls.clear()
    return widest


@given(st.text(min_size=1, max_size=40))
def test_byte_level_text_is_the_whole_decode_at_every_length(text: str) -> None:
    widest = _check(_bytes_decode, list(text.encode("utf-8")))
    assert widest <= 8  # a tail: two chunks of at most a 4-byte character


@given(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=40))
def test_a_leading_space_rule_is_kept_by_decoding_with_the_previous_chunk(ids: list[int]) -> None:
    widest = _check(_metaspace_decode, ids)
    if 3 not in ids:  # a lone "▁" at a window's start decodes to nothing: the window grows
        assert widest <= 2


def test_the_eos_case_decodes_all_but_the_last_token() -> None:
    ids = list("héllo".encode())
    state = Detok()
    for count in range(1, len(ids)):
        _, state = state.text(_bytes_decode, ids, count)
    text, _ = state.text(_bytes_decode, ids, len(ids) - 1)  # the same count again
    assert text == "héll"
