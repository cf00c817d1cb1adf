"""`sart bench --trace` fed random traces, valid and broken (issue 13).

Whatever the file holds, the command ends one of two ways: a one-line error
that names the file and the line, or a finished benchmark in which every
request of the trace is accounted for, completed, in every run. Any other exception, a
traceback or a request gone missing fails the test.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sart.cli import main

ANSWERS = ("1", "2", "3")

# Values that break a field somewhere: wrong types, non-finite and absurd numbers.
BAD_VALUES = [
    float("nan"),
    float("inf"),
    -1,
    1.5,
    1e300,
    2**70,
    0,
    "",
    "x",
    [],
    {},
    None,
    True,
    [float("nan")],
]
# Rewards, in range or not (written alone as a final reward, or in a list).
REWARDS = [float("nan"), float("inf"), -0.1, 1.1, 0.0, 1.0, 0.3]
# Whole lines that are not a request.
BAD_LINES = [b"{", b"[]", b"null", b"42", b'"text"', b'{"id": "\xff"}', b"[" * 5000 + b"]" * 5000]


@st.composite
def branch(draw: st.DrawFn) -> dict[str, Any]:
    length = draw(st.integers(1, 60))
    out: dict[str, Any] = {"length": length, "answer": draw(st.sampled_from(ANSWERS))}
    rewards = st.floats(0, 1, allow_nan=False)
    if draw(st.booleans()):
        out["rewards"] = draw(st.lists(rewards, max_size=min(length, 4)))
    if draw(st.booleans()):
        out["final_reward"] = draw(rewards)
    if draw(st.booleans()):  # per-segment logprobs and confidences (confidence methods)
        every = draw(st.integers(1, 20))
        segments = min(-(-length // every), 4)
        if draw(st.booleans()):
            out["logprob_every"] = every
        else:
            segments = min(-(-length // 16), 4)
        out["logprobs"] = draw(st.lists(st.floats(-30, 0), max_size=segments))
        if draw(st.booleans()):
            out["confidences"] = draw(st.lists(st.floats(0, 30), max_size=segments))
    return out


@st.composite
def request(draw: st.DrawFn, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": f"r{index}",
        "arrival": draw(st.floats(0, 50, allow_nan=False)),
        "answer": draw(st.sampled_from(ANSWERS)),
    }
    if draw(st.booleans()):
        out["prompt_tokens"] = draw(st.integers(1, 64))
    if draw(st.booleans()):
        out["interval"] = draw(st.integers(4, 16))
    out["branches"] = draw(st.lists(branch(), min_size=1, max_size=3))
    return out


@st.composite
def valid_traces(draw: st.DrawFn) -> list[dict[str, Any]]:
    size = draw(st.integers(1, 4))
    return [draw(request(i)) for i in range(size)]


@st.composite
def broken(draw: st.DrawFn, lines: list[dict[str, Any]]) -> list[bytes]:
    """``lines`` as file lines, with one random fault (or none: then a valid trace)."""
    fault = draw(
        st.sampled_from(["none", "value", "reward", "drop", "extra", "line", "repeat", "empty"])
    )
    lines = json.loads(json.dumps(lines))  # a deep copy to break
    target: dict[str, Any] = draw(st.sampled_from(lines))
    if draw(st.booleans()):
        target = draw(st.sampled_from(target["branches"]))
    key = draw(st.sampled_from(sorted(target)))
    if fault == "value":
        target[key] = draw(st.sampled_from(BAD_VALUES))
    elif fault == "reward":
        one = draw(st.sampled_from(draw(st.sampled_from(lines))["branches"]))
        reward = draw(st.sampled_from(REWARDS))
        if draw(st.booleans()):
            one["final_reward"] = reward
        else:
            one["rewards"] = [0.5, reward]
    elif fault == "drop":
        del target[key]
    elif fault == "extra":
        target[draw(st.sampled_from(["Answer", "final_rewards", "note", "confidence"]))] = 1
    elif fault == "repeat":
        lines.append(draw(st.sampled_from(lines)))
    elif fault == "empty":
        lines = []
    raw = [json.dumps(line).encode() for line in lines]  # NaN is written as NaN
    if fault == "line":
        raw.insert(draw(st.integers(0, len(raw))), draw(st.sampled_from(BAD_LINES)))
    if draw(st.booleans()):
        raw.insert(draw(st.integers(0, len(raw))), b"   ")  # blank lines are skipped
    return raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_trace_ends_in_a_clean_error_or_a_full_account(data: st.DataObject) -> None:
    trace = data.draw(valid_traces())
    raw = data.draw(broken(trace))
    valid = [json.dumps(line).encode() for line in trace]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        path.write_bytes(b"\n".join(raw) + b"\n")
        out = Path(tmp) / "out"
        stderr = io.StringIO()
        argv = ["bench", "--trace", str(path), "--methods", "sc", "sart", "rebase"]
        argv += ["--cost-model", "steps", "--no-plots", "--json", "--out", str(out)]
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code
        if code != 0:
            assert code == 2
            message = stderr.getvalue()
            assert message.count("\n") == 1, message  # one line, no traceback
            assert re.match(rf"sart: error: {re.escape(str(path))}(:\d+)?: \S", message), message
            assert [line for line in raw if line.strip()] != valid  # a valid trace always runs
            return
        # An id written as a number is read as its text.
        ids = {str(json.loads(line)["id"]) for line in raw if line.strip()}
        doc = json.loads((out / "results.json").read_text())
        assert doc["complete"]
        assert doc["runs"]
        for run in doc["runs"]:
            records = run["requests"]
            assert sorted(r["id"] for r in records) == sorted(ids)
            # A trace that loads holds nothing that fails a request when replayed
            # (a NaN reward used to load, then fail the PRM methods' requests only).
            assert [r["status"] for r in records] == ["completed"] * len(records), run["method"]
