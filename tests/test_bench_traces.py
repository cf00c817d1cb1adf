"""JSONL traces (``sart.bench.traces``): the line format, round trips, and errors.

A trace line is one request; a malformed line must be refused with a
``ConfigError`` naming ``file:line``, so a user can find it in a file of
thousands of lines.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from sart.bench.traces import (
    DEFAULT_PROMPT_TOKENS,
    ForkModel,
    Trace,
    TraceRequest,
    TraceScript,
)
from sart.bench.workloads import workload
from sart.engines.scripts import BranchScript
from sart.errors import ConfigError
from sart.types import BranchId

#: The example of the module docstring, with its "..." removed.
DOC_EXAMPLE = (
    '{"id": "r0", "arrival": 12.5, "answer": "A", "prompt_tokens": 310, "interval": 400,'
    ' "branches": [{"length": 3120, "answer": "A", "rewards": [0.61, 0.58],'
    ' "final_reward": 0.66}]}'
)

GOOD_LINE = {"id": "ok", "arrival": 0, "answer": "1", "branches": [{"length": 3, "answer": "1"}]}


def branch(length: int, answer: str, *rewards: float, final: float | None = None) -> BranchScript:
    """A branch as a loaded trace holds it (no filler text)."""
    return BranchScript(
        length=length, answer=answer, rewards=rewards, final_reward=final, filler=""
    )


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def small_trace() -> Trace:
    """Rewards with at most 4 decimals, so a dump/load round trip is exact."""
    return Trace.of(
        [
            TraceRequest(
                id="a",
                arrival=0.0,
                answer="7",
                branches=(branch(12, "7", 0.25, 0.5, final=0.9), branch(30, "8", 0.1234)),
                prompt_tokens=40,
                interval=10,
                max_tokens=30,
            ),
            TraceRequest(
                id="b",
                arrival=2.5,
                answer="3",
                branches=(branch(5, "3"), branch(8, "3", 1.0, final=0.0), branch(9, "4")),
            ),
        ]
    )


# ------------------------------------------------------------------ round trips


def test_generated_trace_round_trips(tmp_path: Path) -> None:
    trace = workload("gaokao").generate(5, 2.0, 4, 400, seed=3)
    path = tmp_path / "t.jsonl"
    trace.dump(path)
    loaded = Trace.load(path)
    assert len(loaded) == len(trace) == 5
    for old, new in zip(trace, loaded):
        assert (new.id, new.arrival, new.answer) == (old.id, old.arrival, old.answer)
        assert (new.prompt_tokens, new.interval) == (old.prompt_tokens, old.interval)
        assert [(b.length, b.answer) for b in new.branches] == [
            (b.length, b.answer) for b in old.branches
        ]
        for a, b in zip(old.branches, new.branches):
            assert len(b.rewards) == len(a.rewards) > 0
            assert b.rewards == pytest.approx(a.rewards, abs=5e-5)
            assert b.final_reward == pytest.approx(a.final_reward, abs=5e-5)


def test_a_gzip_compressed_trace_round_trips_and_a_cut_one_is_refused(tmp_path: Path) -> None:
    trace, path = small_trace(), tmp_path / "t.jsonl.gz"
    trace.dump(path)
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # written compressed
    assert Trace.load(path).requests == trace.requests
    path.write_bytes(path.read_bytes()[:-12])  # the machine stopped mid-write
    with pytest.raises(ConfigError, match=r"t\.jsonl\.gz.*not a whole gzip file"):
        Trace.load(path)
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_text(json.dumps(GOOD_LINE) + "\n")  # named .gz, not compressed
    with pytest.raises(ConfigError, match="not a whole gzip file"):
        Trace.load(plain)


def test_four_decimal_rewards_round_trip_exactly(tmp_path: Path) -> None:
    trace = small_trace()
    path = tmp_path / "t.jsonl"
    trace.dump(path)
    assert Trace.load(path) == trace
    # Dumping what was loaded gives the same file.
    again = tmp_path / "again.jsonl"
    Trace.load(path).dump(again)
    assert again.read_text() == path.read_text()


def test_rewards_are_rounded_to_four_decimals_on_dump(tmp_path: Path) -> None:
    trace = Trace.of([TraceRequest("a", 0.0, "1", (branch(4, "1", 0.123456, final=0.987654),))])
    path = tmp_path / "t.jsonl"
    trace.dump(path)
    (line,) = path.read_text().splitlines()
    data = json.loads(line)
    assert data["branches"][0]["rewards"] == [0.1235]
    assert data["branches"][0]["final_reward"] == 0.9877


# ------------------------------------------------------------------ line format


def test_dumped_lines_have_the_documented_keys(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    small_trace().dump(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert list(first) == [
        "id", "arrival", "answer", "prompt_tokens", "interval", "max_tokens", "branches"
    ]  # fmt: skip
    assert first["max_tokens"] == 30
    assert first["branches"][0] == {
        "length": 12,
        "answer": "7",
        "rewards": [0.25, 0.5],
        "final_reward": 0.9,
    }
    # Optional keys are left out when unset.
    assert "interval" not in second and "max_tokens" not in second
    assert second["prompt_tokens"] == DEFAULT_PROMPT_TOKENS
    assert second["branches"][0] == {"length": 5, "answer": "3", "rewards": []}


def test_the_documented_example_loads(tmp_path: Path) -> None:
    loaded = Trace.load(write_lines(tmp_path / "doc.jsonl", [DOC_EXAMPLE]))
    (request,) = loaded
    assert request == TraceRequest(
        id="r0",
        arrival=12.5,
        answer="A",
        branches=(branch(3120, "A", 0.61, 0.58, final=0.66),),
        prompt_tokens=310,
        interval=400,
    )


def test_optional_keys_have_defaults() -> None:
    request = TraceRequest.from_json(
        {"id": 7, "arrival": 1, "answer": 4, "branches": [{"length": 3, "answer": 4}]}
    )
    assert (request.id, request.arrival, request.answer) == ("7", 1.0, "4")
    assert request.prompt_tokens == DEFAULT_PROMPT_TOKENS
    assert request.interval is None and request.max_tokens is None
    assert request.branches == (branch(3, "4"),)


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD_LINE), "", "   "])
    assert [r.id for r in Trace.load(path)] == ["ok"]


# ------------------------------------------------------------------ errors

BAD_LINES = {
    "bad JSON": ("{not json", "not JSON"),
    # JSON's null is a line, not a blank one: refused, not skipped.
    "null": ("null", "the line must be a JSON object, not null"),
    "missing key": ('{"id": "x", "arrival": 0, "answer": "1"}', "branches"),
    "missing branch key": (
        '{"id": "x", "arrival": 0, "answer": "1", "branches": [{"answer": "1"}]}',
        "length",
    ),
    "no branches": ('{"id": "x", "arrival": 0, "answer": "1", "branches": []}', "no branches"),
    "negative arrival": (
        '{"id": "x", "arrival": -1, "answer": "1", "branches": [{"length": 3, "answer": "1"}]}',
        "arrival=-1 must be in [0, 1e+09]",
    ),
    "infinite arrival": (
        '{"id": "x", "arrival": 1e999, "answer": "1", "branches": [{"length": 3, "answer": "1"}]}',
        "arrival",
    ),
    "bad length": (
        '{"id": "x", "arrival": 0, "answer": "1", "branches": [{"length": 0, "answer": "1"}]}',
        "length",
    ),
    "bad reward": (
        '{"id": "x", "arrival": 0, "answer": "1",'
        ' "branches": [{"length": 3, "answer": "1", "rewards": [1.5]}]}',
        "branches[0]: rewards[0]=1.5 must be in [0, 1]",
    ),
    # Issue 13, case 5: these loaded, then failed the PRM methods' requests only.
    "NaN reward": (
        '{"id": "x", "arrival": 0, "answer": "1",'
        ' "branches": [{"length": 3, "answer": "1", "rewards": [0.5, NaN]}]}',
        "rewards[1]=nan must be in [0, 1]",
    ),
    "final reward above 1": (
        '{"id": "x", "arrival": 0, "answer": "1", "branches": [{"length": 3, "answer": "1"},'
        ' {"length": 3, "answer": "1", "final_reward": 1.2}]}',
        "branches[1]: final_reward=1.2 must be in [0, 1]",
    ),
    "reward as text": (
        '{"id": "x", "arrival": 0, "answer": "1",'
        ' "branches": [{"length": 3, "answer": "1", "final_reward": "0.5"}]}',
        "final_reward must be a number, not a string",
    ),
    "more rewards than tokens": (
        '{"id": "x", "arrival": 0, "answer": "1",'
        ' "branches": [{"length": 1, "answer": "1", "rewards": [0.5, 0.5]}]}',
        "2 rewards for a branch of 1 tokens",
    ),
    # Absurd sizes are refused, not allocated or decoded.
    "absurd length": (
        '{"id": "x", "arrival": 0, "answer": "1", "branches": [{"length": 1e15, "answer": "1"}]}',
        "length=1e+15 must be in [1, 16777216]",
    ),
    "absurd prompt": (
        '{"id": "x", "arrival": 0, "answer": "1", "prompt_tokens": 99999999999,'
        ' "branches": [{"length": 3, "answer": "1"}]}',
        "prompt_tokens=99999999999",
    ),
    "fractional length": (
        '{"id": "x", "arrival": 0, "answer": "1", "branches": [{"length": 2.5, "answer": "1"}]}',
        "length must be a whole number, not 2.5",
    ),
    "boolean length": (
        '{"id": "x", "arrival": 0, "answer": "1", "branches": [{"length": true, "answer": "1"}]}',
        "length must be a whole number, not True",
    ),
    "zero interval": (
        '{"id": "x", "arrival": 0, "answer": "1", "interval": 0,'
        ' "branches": [{"length": 3, "answer": "1"}]}',
        "interval=0",
    ),
    # A branch longer than the cap it was generated under: a broken recording.
    "branch past its cap": (
        '{"id": "x", "arrival": 0, "answer": "1", "max_tokens": 8,'
        ' "branches": [{"length": 8, "answer": "1"}, {"length": 9, "answer": ""}]}',
        "a branch of 9 tokens under max_tokens=8",
    ),
    "zero cap": (
        '{"id": "x", "arrival": 0, "answer": "1", "max_tokens": 0,'
        ' "branches": [{"length": 3, "answer": "1"}]}',
        "max_tokens=0",
    ),
    "absurd arrival": (
        '{"id": "x", "arrival": 1e300, "answer": "1", "branches": [{"length": 3, "answer": "1"}]}',
        "arrival=1e+300",
    ),
    "huge integer": (
        '{"id": "x", "arrival": ' + "9" * 5000 + ', "answer": "1", "branches": []}',
        "not a trace line",
    ),
    "deep nesting": ("[" * 100_000 + "]" * 100_000, "not a trace line"),
    "not an object": ("[1, 2, 3]", "the line must be a JSON object, not a list"),
    "branch not an object": (
        '{"id": "x", "arrival": 0, "answer": "1", "branches": [3]}',
        "branches[0]: a branch must be a JSON object, not a number",
    ),
    "too many branches": (
        '{"id": "x", "arrival": 0, "answer": "1", "branches": ['
        + ",".join(['{"length": 1, "answer": "1"}'] * 4097)
        + "]}",
        "4097 branches; at most 4096",
    ),
    # A misspelt optional key took its default without a word.
    "misspelt key": (
        '{"id": "x", "arrival": 0, "answer": "1",'
        ' "branches": [{"length": 3, "answer": "1", "final_rewards": 0.9}]}',
        "unknown key 'final_rewards'",
    ),
    "answer as a list": (
        '{"id": "x", "arrival": 0, "answer": ["1"], "branches": [{"length": 3, "answer": "1"}]}',
        "answer must be a string, not a list",
    ),
    "empty id": (
        '{"id": "", "arrival": 0, "answer": "1", "branches": [{"length": 3, "answer": "1"}]}',
        "id must have 1 to",
    ),
    "lone surrogate": (
        '{"id": "\\ud800", "arrival": 0, "answer": "1",'
        ' "branches": [{"length": 3, "answer": "1"}]}',
        "id is not valid Unicode text",
    ),
}


def test_replay_settings_round_trip_in_a_header_line_and_defaults_write_none(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl.gz"
    for persistence, model in [
        (0.0, None),
        (0.25, ForkModel(intercept=-1.0, slope=2.5)),
        (None, None),
        (0.5, ForkModel()),
    ]:
        trace = Trace.of(small_trace().requests, persistence=persistence, fork_model=model)
        trace.dump(path)
        loaded = Trace.load(path)
        assert (loaded.persistence, loaded.fork_model) == (persistence, model)
        assert loaded.requests == trace.requests
    # A recording from a real PRM keeps the defaults, and its file has no header.
    small_trace().dump(path)
    first = json.loads(gzip.open(path, "rt").readline())
    assert "id" in first and Trace.load(path).fork_model == ForkModel()
    # A header may leave a setting out; an empty one changes nothing.
    lines = [json.dumps({"replay": {"persistence": 0.5}}), json.dumps(GOOD_LINE)]
    loaded = Trace.load(write_lines(tmp_path / "p.jsonl", lines))
    assert (loaded.persistence, loaded.fork_model) == (0.5, ForkModel())
    loaded = Trace.load(write_lines(tmp_path / "e.jsonl", ['{"replay": {}}', *lines[1:]]))
    assert (loaded.persistence, loaded.fork_model) == (None, ForkModel())


BAD_HEADERS = {
    "unknown setting": ({"replay": {"persistance": 0.5}}, "unknown key 'persistance'"),
    "beside replay": ({"replay": {}, "id": "x"}, "unknown key 'id' (a header line has"),
    "not an object": ({"replay": [0.5]}, "replay must be a JSON object, not a list"),
    "persistence out of range": ({"replay": {"persistence": 2}}, "persistence=2 must be in"),
    "fork model without slope": (
        {"replay": {"fork_model": {"intercept": 1}}},
        "fork_model has no 'slope'",
    ),
    "fork model not finite": (
        {"replay": {"fork_model": {"intercept": 1, "slope": 1e300}}},
        "fork_model.slope=1e+300 must be in [-1000, 1000]",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_a_bad_header_names_file_and_line(tmp_path: Path, case: str) -> None:
    header, words = BAD_HEADERS[case]
    path = write_lines(tmp_path / "t.jsonl", ["", json.dumps(header), json.dumps(GOOD_LINE)])
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: ")) as info:
        Trace.load(path)
    assert words in str(info.value)


def test_a_header_must_be_the_first_line(tmp_path: Path) -> None:
    header = json.dumps({"replay": {"persistence": 0.0}})
    after = write_lines(tmp_path / "a.jsonl", [json.dumps(GOOD_LINE), header])
    with pytest.raises(ConfigError, match=f"{after}:2: a header line after requests"):
        Trace.load(after)
    twice = write_lines(tmp_path / "b.jsonl", [header, header, json.dumps(GOOD_LINE)])
    with pytest.raises(ConfigError, match=f"{twice}:2: a second header line"):
        Trace.load(twice)
    alone = write_lines(tmp_path / "c.jsonl", [header])
    with pytest.raises(ConfigError, match="the trace has no requests"):
        Trace.load(alone)


def test_a_resampled_trace_keeps_its_sources_replay_settings(tmp_path: Path) -> None:
    from sart.bench.resample import load_resampled

    generated = workload("gaokao").generate(20, 1.0, 4, 400)
    generated.dump(tmp_path / "g.jsonl")
    drawn = load_resampled(str(tmp_path / "g.jsonl")).generate(10, 1.0, 4, 400)
    assert (drawn.persistence, drawn.fork_model) == (0.0, None)


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_malformed_line_names_file_and_line(tmp_path: Path, case: str) -> None:
    text, words = BAD_LINES[case]
    # Line 1 is fine, line 2 is blank (still counted), line 3 is the bad one.
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD_LINE), "", text])
    with pytest.raises(ConfigError) as info:
        Trace.load(path)
    message = str(info.value)
    assert f"{path}:3" in message
    assert words in message


def test_duplicate_ids_are_refused_naming_both_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD_LINE), json.dumps(GOOD_LINE)])
    with pytest.raises(ConfigError) as info:
        Trace.load(path)
    assert str(info.value) == f"{path}:2: the id 'ok' is already line 1's"


def test_invalid_utf8_names_the_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD_LINE).encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(ConfigError) as info:
        Trace.load(path)
    assert str(info.value) == f"{path}:2: not UTF-8 text (byte 9)"


def test_a_line_over_the_size_limit_is_not_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sart.bench import traces

    monkeypatch.setattr(traces, "MAX_LINE_BYTES", 100)
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD_LINE), "x" * 1000])
    with pytest.raises(ConfigError, match=f"{path}:2: a line longer than"):
        Trace.load(path)


def test_empty_file_is_refused(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [""])
    with pytest.raises(ConfigError, match="no requests") as info:
        Trace.load(path)
    assert str(path) in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(ConfigError, match=r"absent\.jsonl"):
        Trace.load(path)


def test_of_refuses_empty_and_duplicates() -> None:
    with pytest.raises(ConfigError, match="no requests"):
        Trace.of([])
    request = TraceRequest("a", 0.0, "1", (branch(3, "1"),))
    with pytest.raises(ConfigError, match="request 2 repeats the id 'a'"):
        Trace.of([request, request])


# ------------------------------------------------------------------ trace queries


def test_width_is_the_fewest_branches_of_any_request() -> None:
    assert small_trace().width == 2
    one = Trace.of([TraceRequest("a", 0.0, "1", (branch(3, "1"),) * 5)])
    assert one.width == 5


def test_interval_is_set_only_when_every_request_agrees() -> None:
    assert small_trace().interval is None  # 10 and None
    same = Trace.of(
        [TraceRequest(rid, 0.0, "1", (branch(3, "1"),), interval=16) for rid in ("a", "b")]
    )
    assert same.interval == 16
    mixed = Trace.of(
        [
            TraceRequest("a", 0.0, "1", (branch(3, "1"),), interval=16),
            TraceRequest("b", 0.0, "1", (branch(3, "1"),), interval=32),
        ]
    )
    assert mixed.interval is None
    unset = Trace.of([TraceRequest("a", 0.0, "1", (branch(3, "1"),))])
    assert unset.interval is None


def test_script_looks_branches_up_and_gold_maps_ids_to_answers() -> None:
    trace = small_trace()
    script = trace.script()
    assert script(BranchId("a", 1)) == branch(30, "8", 0.1234)
    assert script(BranchId("b", 2)) == branch(9, "4")
    assert trace.gold() == {"a": "7", "b": "3"}


# ------------------------------------------------------------------ log-probabilities

WITH_LOGPROBS = (
    '{"id": "x", "arrival": 0, "answer": "1", "branches": [{"length": 40, "answer": "1",'
    ' "logprobs": [-0.25, -1.5], "confidences": [3.5, 0.75, 0.5], "logprob_every": 16},'
    ' {"length": 9, "answer": "2", "confidences": [1]}]}'
)


def test_logprobs_load_into_the_branch_scripts(tmp_path: Path) -> None:
    (request,) = Trace.load(write_lines(tmp_path / "t.jsonl", [WITH_LOGPROBS]))
    first, second = request.branches
    assert (first.logprobs, first.confidences, first.logprob_every) == (
        (-0.25, -1.5),
        (3.5, 0.75, 0.5),
        16,
    )
    assert (second.logprobs, second.confidences, second.logprob_every) == ((), (1.0,), 16)
    # Trace.script() carries them to the engine: token 16 starts the second segment.
    script = Trace.of([request]).script()(BranchId("x", 0))
    assert [script.logprob_at(i) for i in (0, 15, 16, 39)] == [-0.25, -0.25, -1.5, -1.5]
    assert [script.confidence_at(i) for i in (15, 16, 32)] == [3.5, 0.75, 0.5]


def test_logprobs_round_trip_and_old_traces_are_unchanged(tmp_path: Path) -> None:
    with_lp = TraceRequest(
        "a",
        0.0,
        "1",
        (
            BranchScript(
                length=50,
                answer="1",
                rewards=(0.5,),
                filler="",
                logprobs=(-0.123456, -2.0),
                confidences=(4.0, 0.00001),
                logprob_every=25,
            ),
            branch(7, "2"),
        ),
    )
    path = tmp_path / "t.jsonl"
    Trace.of([with_lp]).dump(path)
    data = json.loads(path.read_text())
    assert data["branches"][0] == {
        "length": 50,
        "answer": "1",
        "rewards": [0.5],
        "logprobs": [-0.1235, -2.0],
        "confidences": [4.0, 0.0],
        "logprob_every": 25,
    }
    # A branch without them is written as before.
    assert data["branches"][1] == {"length": 7, "answer": "2", "rewards": []}
    loaded = Trace.load(path)
    assert loaded.requests[0].branches[0].logprobs == (-0.1235, -2.0)
    again = tmp_path / "again.jsonl"
    loaded.dump(again)
    assert again.read_text() == path.read_text()
    # A trace written before these fields existed loads and dumps unchanged.
    old = write_lines(tmp_path / "old.jsonl", [DOC_EXAMPLE])
    (request,) = Trace.load(old)
    assert request.branches[0].logprobs == request.branches[0].confidences == ()
    Trace.load(old).dump(again)
    assert json.loads(again.read_text()) == json.loads(DOC_EXAMPLE)


def test_default_segment_length_agrees_with_the_scripts() -> None:
    from sart.bench import trace_lines
    from sart.engines import scripts

    assert trace_lines.DEFAULT_LOGPROB_EVERY == scripts.DEFAULT_LOGPROB_EVERY


def line_with(**fields: object) -> str:
    return json.dumps(
        {
            "id": "x",
            "arrival": 0,
            "answer": "1",
            "branches": [{"length": 32, "answer": "1", **fields}],
        }
    )


BAD_LOGPROB_LINES = {
    "positive logprob": (line_with(logprobs=[-1, 0.5]), "branches[0]: logprobs[1]=0.5 must be in"),
    "NaN logprob": (line_with(logprobs=[float("nan")]), "logprobs[0]=nan must be in"),
    "infinite logprob": (line_with(logprobs=[float("-inf")]), "logprobs[0]=-inf must be in"),
    "negative confidence": (line_with(confidences=[-0.5]), "confidences[0]=-0.5 must be in [0,"),
    "confidence as text": (line_with(confidences=["1"]), "confidences[0] must be a number"),
    "logprobs not a list": (line_with(logprobs=-1), "logprobs must be a list, not a number"),
    "zero segment": (line_with(logprobs=[-1], logprob_every=0), "logprob_every=0 must be in"),
    "fractional segment": (line_with(logprob_every=2.5), "logprob_every must be a whole number"),
    "more values than segments": (
        line_with(confidences=[1, 1, 1], logprob_every=16),
        "3 confidences for a branch of 32 tokens in segments of 16 (at most one per segment)",
    ),
    "more than the default segments": (
        line_with(logprobs=[-1, -1, -1]),
        "3 logprobs for a branch of 32 tokens in segments of 16",
    ),
    "misspelt": (line_with(confidence=[1]), "unknown key 'confidence'"),
}


@pytest.mark.parametrize("case", sorted(BAD_LOGPROB_LINES))
def test_bad_logprobs_name_file_and_line(tmp_path: Path, case: str) -> None:
    text, words = BAD_LOGPROB_LINES[case]
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD_LINE), text])
    with pytest.raises(ConfigError) as info:
        Trace.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: "), message
    assert words in message, message


def test_recorded_logprobs_replay_through_the_fake_engine() -> None:
    """record_trace keeps each branch's per-segment means of what the engine reported;
    a replay of the trace reports those means back."""
    from sart.bench.real import PromptItem, record_trace
    from sart.engines.base import BranchSpec
    from sart.testing import FakeEngine, ScriptedPRM
    from sart.types import SamplingSettings

    drop = BranchScript(
        length=60, logprobs=(-0.5,) * 5 + (-2.0,), confidences=(3.0,) * 5 + (1.0,), logprob_every=8
    )
    flat = BranchScript(length=10, logprobs=(-1.0,), confidences=(0.25,))
    table = {"q": [drop, flat]}
    items = [PromptItem("q", "a prompt", "42")]
    sampling = SamplingSettings(max_tokens=100, logprobs=3)
    trace = record_trace(
        items, FakeEngine(table), ScriptedPRM(table, every=4), 2, 4, sampling, rate=1.0
    )
    recorded, short = trace.requests[0].branches
    # Segments of 16: tokens 32..39 at the higher value, 40..47 at the lower one.
    assert recorded.logprob_every == 16
    assert recorded.logprobs == (-0.5, -0.5, -1.25, -2.0)
    assert recorded.confidences == (3.0, 3.0, 2.0, 1.0)
    assert (short.logprobs, short.confidences) == ((-1.0,), (0.25,))
    # Without logprobs in the sampling nothing is recorded.
    plain = record_trace(
        items, FakeEngine(table), ScriptedPRM(table, every=4), 2, 4, SamplingSettings(), 1.0
    )
    assert all(b.logprobs == b.confidences == () for b in plain.requests[0].branches)
    # k = 0: the sampled tokens' logprobs, no confidences.
    zero = record_trace(
        items,
        FakeEngine(table),
        ScriptedPRM(table, every=4),
        2,
        4,
        SamplingSettings(max_tokens=100, logprobs=0),
        1.0,
    )
    first = zero.requests[0].branches[0]
    assert (first.logprobs, first.confidences) == ((-0.5, -0.5, -1.25, -2.0), ())
    # The replay reports the recorded means.
    replay = FakeEngine(trace.script())
    replay.prefill("q", "a prompt", sampling)
    replay.start_branches("q", [BranchSpec(0, 0)])
    tokens = replay.step(100).deltas[BranchId("q", 0)].logprobs
    assert [t.logprob for t in tokens] == [-0.5] * 32 + [-1.25] * 16 + [-2.0] * 12


def test_recorded_logprobs_are_clamped_to_the_trace_range() -> None:
    """A token given probability 0 reports -inf (and a broken engine NaN): the recording
    still loads, with the token counted at the trace's floor."""
    from sart.bench.real import LogprobRecorder
    from sart.bench.trace_lines import MIN_LOGPROB
    from sart.engines.base import BranchDelta, StepOutput, TokenLogprobs

    inf, nan = float("inf"), float("nan")
    tokens = (
        TokenLogprobs(-inf, (-1.0, -inf)),
        TokenLogprobs(nan, (-1.0, -3.0)),
        TokenLogprobs(1e-9, (1e-9, -2.0)),
    )

    class Reports:
        def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
            delta = BranchDelta(new_tokens=3, text="", logprobs=tokens)
            return StepOutput(steps=3, deltas={BranchId("r", 0): delta})

    recorder = LogprobRecorder(Reports(), every=2)  # type: ignore[arg-type]
    recorder.step(3)
    fields = recorder.fields(BranchId("r", 0), 3)
    assert fields["logprobs"] == (MIN_LOGPROB, 0.0)
    # Token 0: -(-1 + floor) / 2; token 1: 2.0.
    assert fields["confidences"] == (pytest.approx(((1.0 - MIN_LOGPROB) / 2 + 2.0) / 2), 1.0)
    script = BranchScript(length=3, **fields)  # within BranchScript's and the trace's range
    assert script.logprobs[0] == MIN_LOGPROB
    # A branch some of whose tokens came without logprobs records none.
    assert recorder.fields(BranchId("r", 0), 4) == {}
    assert recorder.fields(BranchId("r", 1), 3) == {}


# ------------------------------------------------------------------ forks (Rebase)

#: One request with a correct answer "7" on two branches and "8", "9" on the others.
FORK_REQUEST = TraceRequest(
    "q",
    0.0,
    "7",
    (
        branch(1000, "7", *(0.9,) * 10, final=0.95),
        branch(2000, "7", *(0.8,) * 20, final=0.85),
        branch(1500, "8", *(0.2,) * 15, final=0.1),
        branch(3000, "9", *(0.3,) * 30, final=0.2),
    ),
    interval=100,
)


def fork_children(position: int, count: int = 400) -> list[BranchScript]:
    script = Trace.of([FORK_REQUEST]).script()
    return [script.fork(BranchId("q", 4 + i), BranchId("q", 0), position) for i in range(count)]


def test_an_early_fork_samples_the_requests_answers_afresh() -> None:
    children = fork_children(position=10)  # 1% of its parent's way
    share = {a: sum(c.answer == a for c in children) / len(children) for a in "789"}
    # Like a fresh branch: "7" on 2 of the 4 recorded branches, "8" and "9" on one each.
    assert share["7"] == pytest.approx(0.5, abs=0.08)
    assert share["8"] == pytest.approx(0.25, abs=0.08)
    assert share["9"] == pytest.approx(0.25, abs=0.08)


def test_a_late_fork_mostly_keeps_its_parents_answer() -> None:
    children = fork_children(position=900)  # 90% of its parent's way
    kept = sum(c.answer == "7" for c in children) / len(children)
    # 0.9 kept outright, plus the fresh draws that land on "7" again: 0.9 + 0.1 * 0.5.
    assert kept == pytest.approx(0.95, abs=0.04)


def test_a_fork_writes_its_own_remainder_from_the_same_share_of_another_branch() -> None:
    for child in fork_children(position=500, count=50):
        # Half its parent's way: the rest is half of a recorded branch with its answer.
        lengths = {b.length for b in FORK_REQUEST.branches if b.answer == child.answer}
        assert child.length - 500 in {round(length / 2) for length in lengths}
    sevens = {c.length for c in fork_children(position=500, count=50) if c.answer == "7"}
    # 500 more (half of branch 0: its own future) or 1000 (half of branch 1).
    assert sevens == {1000, 1500}, "a continuation is drawn, not its parent's copied"


def test_a_forks_rewards_are_its_parents_up_to_the_fork_then_move_as_its_sources() -> None:
    """The PRM rates a child's prefix as its parent's; after the fork, where reward
    gaps persist, the child's reward moves by what its source's moved from the same
    share of its way (the source's changes, not its levels), within [0, 1]."""
    request = TraceRequest(
        "q",
        0.0,
        "7",
        (
            branch(400, "7", 0.6, 0.7, 0.8, 0.8, final=0.85),  # the mother
            branch(400, "3", 0.5, 0.4, 0.2, 0.1, final=0.05),  # slips: its reward falls
            branch(400, "7", 0.1, 0.2, 0.9, 1.0, final=0.9),  # climbs past 1 once shifted
        ),
        interval=100,
    )
    script = TraceScript(Trace.of([request]), persistence=1.0)
    children = [script.fork(BranchId("q", 3 + i), BranchId("q", 0), 200) for i in range(200)]
    # Forked halfway: the mother's reward there is 0.7; a source's is its second, and
    # its rewards from the third on are shifted by the difference.
    expected = {
        (0.6, 0.7, 0.8, 0.8): 0.85,  # the mother's own future: no shift
        (0.6, 0.7, 0.5, 0.4): 0.35,  # the slip's, shifted up by 0.3
        (0.6, 0.7, 1.0, 1.0): 1.0,  # the climber's, shifted by 0.5 and clamped
    }
    seen = {tuple(round(r, 6) for r in c.rewards): c.final_reward for c in children}
    assert seen.keys() == expected.keys(), "each source drawn, each shifted"
    for rewards, final in seen.items():
        assert final == pytest.approx(expected[rewards])
    # Before the first check both sides are at the neutral 0.5: no shift.
    early = script.fork(BranchId("q", 999), BranchId("q", 0), 50)
    assert early.rewards in {b.rewards for b in request.branches}
    # One reward per T = 100 tokens, to the child's own end, whatever its length.
    for child in fork_children(position=500, count=50):
        assert child.rewards[:5] == (0.9,) * 5  # the parent's, on the shared prefix
        assert len(child.rewards) == pytest.approx(child.length / 100, abs=1)
    # Where gaps do not persist at all, the child takes its source's levels.
    levels = TraceScript(Trace.of([request]), persistence=0.0)
    for i in range(50):
        child = levels.fork(BranchId("q", 3 + i), BranchId("q", 0), 200)
        assert any(
            child.rewards[2:] == b.rewards[2:] and child.final_reward == b.final_reward
            for b in request.branches
        )


def test_reward_persistence_reads_how_far_a_gap_carries_to_the_next_check() -> None:
    from sart.bench.traces import reward_persistence

    rng = random.Random(0)

    def request(i: int, rewards: Callable[[int], tuple[float, ...]]) -> TraceRequest:
        return TraceRequest(
            f"q{i}", 0.0, "7", tuple(branch(600, "7", *rewards(k)) for k in range(4))
        )

    # A gap that stays (a branch's own level) carries in full; per-check noise does not.
    lasting = [request(i, lambda k: (0.2 * k + 0.1,) * 6) for i in range(20)]
    fleeting = [request(i, lambda k: tuple(rng.random() for _ in range(6))) for i in range(200)]
    assert reward_persistence(Trace.of(lasting)) == pytest.approx(1.0)
    assert abs(reward_persistence(Trace.of(fleeting))) < 0.05
    # Levels with variance 0.0125 under noise of 0.0075: about 0.0125 / 0.02 carries.
    both = [
        request(i, lambda k: tuple(0.1 * k + 0.3 * rng.random() for _ in range(6)))
        for i in range(200)
    ]
    assert 0.55 < reward_persistence(Trace.of(both)) < 0.7
    # Every branch alike (gaps of rounding only), or no branch scored twice: nothing to read.
    assert reward_persistence(Trace.of([request(0, lambda k: (0.1, 0.3, 0.7) * 2)])) == 0.0
    assert reward_persistence(Trace.of([request(0, lambda k: (0.5,))])) == 0.0
    # The script reads it from its trace unless told.
    assert TraceScript(Trace.of(lasting)).persistence == pytest.approx(1.0)


def test_forks_are_deterministic_and_looked_up_after() -> None:
    one, two = fork_children(300, count=20), fork_children(300, count=20)
    assert one == two
    script = Trace.of([FORK_REQUEST]).script()
    child = script.fork(BranchId("q", 9), BranchId("q", 1), 300)
    assert script(BranchId("q", 9)) is child


def test_a_fork_of_a_fork_continues_from_the_childs_own_script() -> None:
    script = Trace.of([FORK_REQUEST]).script()
    child = script.fork(BranchId("q", 4), BranchId("q", 2), 100)
    grandchild = script.fork(BranchId("q", 5), BranchId("q", 4), child.length - 1)
    assert (
        grandchild.rewards[: (child.length - 1) // 100]
        == child.rewards[: (child.length - 1) // 100]
    )
    assert grandchild.length > child.length - 1


def test_a_branch_that_wrote_no_answer_loads(tmp_path: Path) -> None:
    line = {"id": "r", "arrival": 0, "answer": "1", "branches": [{"length": 9, "answer": ""}]}
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(line)])
    (request,) = Trace.load(path)
    assert request.branches[0].answer == ""


def test_a_forks_correctness_follows_its_parents_reward_at_the_fork() -> None:
    from sart.bench.traces import ForkModel, TraceScript

    def branch(answer: str, reward: float) -> BranchScript:
        return BranchScript(length=200, answer=answer, rewards=(reward,) * 4, final_reward=reward)

    request = TraceRequest(
        id="q",
        arrival=0.0,
        answer="7",
        branches=(branch("7", 0.9), branch("3", 0.2), branch("7", 0.8), branch("3", 0.3)),
        interval=50,
    )
    trace = Trace.of([request])

    def right_share(parent: int, model: ForkModel | None) -> float:
        script = TraceScript(trace, None, model)
        answers = [
            script.fork(BranchId("q", 4 + k), BranchId("q", parent), 60).answer for k in range(400)
        ]
        return sum(a == "7" for a in answers) / len(answers)

    model = ForkModel()
    assert model.right(0.9) > 0.9 and model.right(0.2) < 0.1
    # Forked at 60 tokens: the parent's reward then is its first, 0.9 or 0.2.
    assert right_share(0, model) > 0.85 and right_share(1, model) < 0.15
    # The former draw ignores the reward: a wrong parent's children are right as
    # often as a fresh branch is, less the share kept (60 / 200).
    assert 0.2 < right_share(1, None) < 0.5


def test_generated_presets_fork_at_their_sources_levels_and_recordings_read_theirs(
    tmp_path: Path,
) -> None:
    from sart.bench.traces import reward_persistence

    generated = workload("gaokao").generate(20, 1.0, 4, 400)
    assert generated.persistence == 0.0 and generated.script().persistence == 0.0
    # Written out and read back, it keeps its setting (the file's header says it);
    # without a header a trace is a recording like any other: read from its rewards.
    generated.dump(tmp_path / "t.jsonl")
    assert Trace.load(tmp_path / "t.jsonl").script().persistence == 0.0
    loaded = Trace.of(generated.requests)
    assert loaded.persistence is None
    assert loaded.script().persistence == reward_persistence(loaded) > 0.3
    with pytest.raises(ConfigError, match=r"persistence=1.5 must be in \[0, 1\]"):
        Trace.of(loaded.requests, persistence=1.5)


def test_generated_presets_fork_by_their_requests_answers_not_the_fitted_model() -> None:
    # A hard request: every recorded branch wrong, yet rated well. The model fitted to
    # a real PRM's forks reads the parent's reward alone and makes right children of
    # it; a generated preset's rewards are not on that PRM's scale, so its forks keep
    # to the answers its request has (none right here).
    hard = TraceRequest(
        "h", 0.0, "7", tuple(branch(1000, a, *(0.85,) * 10) for a in "8989"), interval=100
    )

    def right(trace: Trace) -> int:
        script = trace.script()
        children = [script.fork(BranchId("h", 4 + i), BranchId("h", 0), 500) for i in range(200)]
        return sum(c.answer == "7" for c in children)

    assert right(Trace.of([hard])) > 100  # fitted: P(right) about 0.94 at reward 0.85
    assert right(Trace.of([hard], fork_model=None)) == 0
    generated = workload("gaokao").generate(3, rate=1.0, n=4, interval=400)
    assert generated.fork_model is None and generated.persistence == 0.0
