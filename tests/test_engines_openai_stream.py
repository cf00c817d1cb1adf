"""``sart.engines.openai_stream``: the completions stream parsed from literal SSE bytes."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.engines.base import TokenLogprobs
from sart.engines.openai_stream import (
    Delta,
    Done,
    LogprobsError,
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
        b'data: {"error": {"message": "out of vocab", "code": 400}}\n\n'
    )
    first, second, third, fourth = parse_stream([body])
    assert first == Delta("a")
    assert isinstance(second, StreamError) and "out of memory" in second.message
    assert second.message.startswith("reported an error: ")
    assert isinstance(third, StreamError) and "bad" in third.message
    # The status the event carries (vLLM's shape in the last; the first's flat one).
    assert [second.code, third.code, fourth.code] == [500, None, 400]


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


# Chunks of vLLM 0.32's stream (`vllm serve` of the demo policy) with `logprobs: 3`:
# top_logprobs holds the sampled token's entry first, then the 3 most likely.
# With return_tokens_as_token_ids the keys are ids; with text keys, tokens 187 and
# 247 (both decoding to "") share one: the sampled token's value is overwritten by
# token 247's and the object keeps three entries, not four. VLLM_GREEDY: greedy,
# the sampled token 177 (the most likely) shares "" with token 247, whose value
# takes the key: the object's highest value is not the most likely token's.
VLLM_IDS = (
    b'data: {"choices":[{"index":0,"text":"","logprobs":{"text_offset":[0],'
    b'"token_logprobs":[-6.214146614074707],"tokens":["token_id:187"],"top_logprobs":'
    b'[{"token_id:187":-6.214146614074707,"token_id:262":-5.65717887878418,'
    b'"token_id:247":-5.665900230407715,"token_id:21":-5.6989288330078125}]},'
    b'"finish_reason":null,"token_ids":[187]}]}\n\n'
)
VLLM_TEXT = (
    b'data: {"choices":[{"index":0,"text":"","logprobs":{"text_offset":[0],'
    b'"token_logprobs":[-6.214146614074707],"tokens":[""],"top_logprobs":'
    b'[{"":-5.665900230407715," a":-5.65717887878418,"2":-5.6989288330078125}]},'
    b'"finish_reason":null,"token_ids":[187]}]}\n\n'
)


VLLM_GREEDY = (
    b'data: {"choices":[{"index":0,"text":"","logprobs":{"text_offset":[36],'
    b'"token_logprobs":[-5.540808200836182],"tokens":[""],"top_logprobs":'
    b'[{"":-5.622334957122803,"l":-5.622715950012207}]},"finish_reason":null}]}\n\n'
)


def test_vllm_logprobs_parse_to_every_value_highest_first() -> None:
    (delta,) = parse_stream([VLLM_IDS])
    assert isinstance(delta, Delta) and delta.token_ids == (187,)
    top = (-5.65717887878418, -5.665900230407715, -5.6989288330078125, -6.214146614074707)
    ids = (262, 247, 21, 187)
    assert delta.logprobs == (TokenLogprobs(-6.214146614074707, top, 187, ids),)
    # Tally keeps the k highest: the sampled token's own entry (rank 4 here) drops out.
    assert Tally(top_k=3).chunk(delta).logprobs == (
        TokenLogprobs(-6.214146614074707, top[:3], 187, ids[:3]),
    )
    assert Tally(top_k=0).chunk(delta).logprobs == (TokenLogprobs(-6.214146614074707, (), 187),)
    assert Tally().chunk(delta).logprobs == ()  # not asked for: ignored


def test_text_keys_that_collide_never_lose_the_sampled_tokens_value() -> None:
    # What OpenAIEngine avoids with return_tokens_as_token_ids (SGLang's server
    # ignores it). The sampled token's value comes in token_logprobs too: it is put
    # back among the top values when its entry lost its key.
    (delta,) = parse_stream([VLLM_TEXT])
    (lp,) = Tally(top_k=3).chunk(delta).logprobs
    assert lp.logprob == -6.214146614074707
    assert lp.top == (-5.65717887878418, -5.665900230407715, -5.6989288330078125)
    (greedy,) = parse_stream([VLLM_GREEDY])
    (lp,) = Tally(top_k=3).chunk(greedy).logprobs
    assert lp.top == (-5.540808200836182, -5.622334957122803, -5.622715950012207)
    assert lp.logprob == lp.top[0]
    # A value lost between two other tokens is lost: fewer than k values.
    lost = parse_event(
        '{"choices":[{"text":"","logprobs":{"token_logprobs":[-3.0],'
        '"top_logprobs":[{"a":-3.0,"":-1.0}]}}]}'
    )
    assert isinstance(lost, Delta)
    assert Tally(top_k=3).chunk(lost).logprobs == (TokenLogprobs(-3.0, (-1.0, -3.0)),)


def test_sglang_logprobs_hold_the_top_k_only() -> None:
    # A chunk of SGLang 0.5.23's stream (`sglang.launch_server` of the demo policy,
    # logprobs: 3): two tokens, each with its 3 most likely (the sampled ones not
    # among them), keyed by text (it ignores return_tokens_as_token_ids).
    body = (
        b'data: {"choices":[{"index":0,"text":"2832","logprobs":{"text_offset":[-1,-1],'
        b'"token_logprobs":[-5.764143943786621,-5.897188186645508],"tokens":["28","32"],'
        b'"top_logprobs":[{"\\u0015":-5.58433723449707," 22":-5.601041793823242,'
        b'"\xc3\xad":-5.653863430023193},{"che":-5.462064743041992,'
        b'"29":-5.604918956756592,"58":-5.650669097900391}]},"finish_reason":null,'
        b'"token_ids":[352,356]}]}\n\n'
    )
    (delta,) = parse_stream([body])
    first = (-5.58433723449707, -5.601041793823242, -5.653863430023193)
    second = (-5.462064743041992, -5.604918956756592, -5.650669097900391)
    assert Tally(top_k=3).chunk(delta).logprobs == (
        TokenLogprobs(-5.764143943786621, first),
        TokenLogprobs(-5.897188186645508, second),
    )
    # logprobs: 0: SGLang sends an empty top_logprobs list.
    zero = parse_event(
        '{"choices":[{"text":" a","logprobs":{"text_offset":[-1],'
        '"token_logprobs":[-5.65717887878418],"tokens":[" a"],"top_logprobs":[]}}]}'
    )
    assert isinstance(zero, Delta)
    assert Tally(top_k=0).chunk(zero).logprobs == (TokenLogprobs(-5.65717887878418),)


def test_logprobs_count_the_tokens_without_ids_and_must_match_them() -> None:
    one = TokenLogprobs(-1.0, (-0.5,))
    tally = Tally(top_k=1)
    # No ids: one token per logprob, whatever usage and text say.
    chunk = tally.chunk(Delta("xy", completion_tokens=5, logprobs=(one, one)))
    assert chunk == Chunk(text="xy", count=2, logprobs=(one, one)) and tally.counted == 2
    assert tally.top_up(chunk, Usage(2)) == chunk
    with pytest.raises(LogprobsError, match="reports 3 tokens"):
        tally.top_up(chunk, Usage(3))  # a token that came without its logprobs
    with pytest.raises(LogprobsError, match="2 tokens came with 1 logprobs"):
        tally.chunk(Delta("z", token_ids=(4, 5), logprobs=(one,)))
    with pytest.raises(LogprobsError, match="1 tokens came with 0 logprobs"):
        tally.chunk(Delta("z", token_ids=(4,)))


@pytest.mark.parametrize(
    "logprobs",
    ['{"token_logprobs": [null]}', '{"top_logprobs": []}', '{"token_logprobs": ["x"]}', "[1]"],
)
def test_malformed_logprobs_are_an_error_event(logprobs: str) -> None:
    event = parse_event('{"choices": [{"text": "a", "logprobs": ' + logprobs + "}]}")
    assert isinstance(event, StreamError) and "malformed logprobs" in event.message
