"""``sart.engines.openai_stream``: the completions stream parsed from literal SSE bytes."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.engines.openai_stream import (
    Delta,
    Done,
    SSEDecoder,
    StreamError,
    StreamParser,
    Tally,
    Usage,
    parse_event,
    parse_stream,
)
from sart.engines.streaming import Chunk

# A vLLM stream with return_token_ids and continuous usage: two tokens, then the final
# usage chunk (it counts an EOS token that had no text) and [DONE].
VLLM = (
    b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":" Hi",'
    b'"token_ids":[11],"prompt_token_ids":[1,2],"finish_reason":null}],'
    b'"usage":{"completion_tokens":1}}\n\n'
    b'data: {"id":"c","choices":[{"index":0,"text":"!","token_ids":[12],'
    b'"finish_reason":"stop"}],"usage":{"completion_tokens":2}}\n\n'
    b'data: {"id":"c","choices":[],"usage":{"completion_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)
VLLM_EVENTS = [
    Delta(" Hi", token_ids=(11,), prompt_token_ids=(1, 2), completion_tokens=1),
    Delta("!", token_ids=(12,), finish_reason="stop", completion_tokens=2),
    Usage(3),
    Done(),
]


def decode(body: bytes, size: int) -> list[str]:
    """``body`` through an ``SSEDecoder`` in pieces of ``size`` bytes."""
    decoder = SSEDecoder()
    data = [d for i in range(0, len(body), size) for d in decoder.feed(body[i : i + size])]
    return data + decoder.end()


def test_a_vllm_stream_parses_to_its_events() -> None:
    assert parse_stream([VLLM]) == VLLM_EVENTS


@given(st.lists(st.integers(0, len(VLLM)), max_size=12))
def test_how_the_bytes_are_cut_does_not_matter(cuts: list[int]) -> None:
    edges = [0, *sorted(cuts), len(VLLM)]
    assert parse_stream(VLLM[a:b] for a, b in itertools.pairwise(edges)) == VLLM_EVENTS


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_sse_events_are_cut_at_cr_and_lf_only(size: int) -> None:
    # A model can generate Unicode line separators; servers put them in JSON unescaped.
    text = "a\u2028b\x85c\u2029d\x0be"
    body = (
        "data: " + json.dumps({"t": text}, ensure_ascii=False) + "\r\n\r\n"
        ': a comment\rdata: {"u": 1}\n\ndata: [DONE]'
    ).encode()

    data = decode(body, size)
    assert data == [json.dumps({"t": text}, ensure_ascii=False), '{"u": 1}', "[DONE]"]
    assert json.loads(data[0])["t"] == text


def test_comments_keep_alives_and_other_fields_are_skipped() -> None:
    body = b': ping\n\n:\n\nevent: message\nid: 7\nretry: 100\ndata: {"a": 1}\n\n: bye\n\n'
    assert decode(body, 1000) == ['{"a": 1}']


@pytest.mark.parametrize("size", [1, 2, 1000])
def test_data_lines_of_one_event_are_joined(size: int) -> None:
    # CRLF line ends, cut between CR and LF when size is 1: still one event.
    body = b'data: {"choices": [{"text": "x",\r\ndata:  "index": 0}]}\r\n\r\n'
    assert decode(body, size) == ['{"choices": [{"text": "x",\n "index": 0}]}']
    assert parse_stream([body]) == [Delta("x")]
    # Empty data is an event all the same, as the SSE format says (and not JSON).
    assert decode(b"data\n\ndata:\n\n", size) == ["", ""]


def test_nothing_after_done_counts() -> None:
    body = b'data: [DONE]\n\ndata: {"choices": [{"text": "late"}]}\n\ndata: not json\n\n'
    parser = StreamParser()
    assert parser.feed(body) == [Done()] and parser.done
    assert parser.feed(b'data: {"choices": []}\n\n') == [] and parser.end() == []


def test_a_truncated_stream_gives_what_it_got_and_no_done() -> None:
    body = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}'
    parser = StreamParser()
    assert parser.feed(body) == [Delta("a")]
    assert parser.end() == [Delta("b")] and not parser.done
    (cut,) = parse_stream([b'data: {"choices": [{"te'])
    assert isinstance(cut, StreamError) and "invalid JSON" in cut.message


def test_an_error_object_mid_stream_is_an_error_event() -> None:
    body = (
        b'data: {"choices": [{"text": "a"}]}\n\n'
        b'data: {"object": "error", "message": "out of memory", "code": 500}\n\n'
        b'data: {"error": {"message": "bad"}}\n\n'
    )
    first, second, third = parse_stream([body])
    assert first == Delta("a")
    assert isinstance(second, StreamError) and "out of memory" in second.message
    assert second.message.startswith("reported an error: ")
    assert isinstance(third, StreamError) and "bad" in third.message


@pytest.mark.parametrize(
    ("data", "why"),
    [("{not json", "invalid JSON"), ("", "invalid JSON"), ("[1, 2]", "not a JSON object")],
)
def test_data_that_is_not_a_json_object_is_an_error_event(data: str, why: str) -> None:
    event = parse_event(data)
    assert isinstance(event, StreamError) and why in event.message


def test_fields_are_read_where_present_and_ignored_where_malformed() -> None:
    assert parse_event('{"choices": [{"text": null, "finish_reason": "length"}]}') == Delta(
        "", finish_reason="length"
    )
    assert parse_event('{"choices": [{"text": "x"}], "usage": {"completion_tokens": "3"}}') == (
        Delta("x")
    )
    assert parse_event('{"choices": [{"text": "x", "prompt_token_ids": []}]}') == Delta("x")
    assert parse_event('{"choices": null, "usage": null}') == Usage(None)
    assert parse_event('{"id": "c", "usage": {"completion_tokens": 9}}') == Usage(9)


def test_tally_counts_ids_then_usage_then_text() -> None:
    tally = Tally()
    assert tally.chunk(Delta("a", token_ids=(5, 6), completion_tokens=9)) == Chunk((5, 6), "a")
    assert tally.counted == 2
    # Cumulative usage: the growth since the last count (never negative).
    assert tally.chunk(Delta("b", completion_tokens=5)) == Chunk(text="b", count=3)
    assert tally.chunk(Delta("c", completion_tokens=4)) == Chunk(text="c", count=0)
    # Neither: one token per chunk with text.
    assert tally.chunk(Delta("d")) == Chunk(text="d", count=1)
    assert tally.chunk(Delta("")) == Chunk(text="", count=0)
    assert tally.counted == 6


def test_the_final_usage_tops_up_the_last_chunk() -> None:
    tally = Tally()
    last = tally.chunk(Delta("x", token_ids=(7,)))
    assert tally.top_up(last, Usage(None)) == last
    assert tally.top_up(last, Usage(1)) == last
    topped = tally.top_up(last, Usage(3))
    assert topped == Chunk(text="x", count=3) and topped.tokens == 3  # ids no longer match
    assert tally.counted == 3
