"""Reading one trace line: every value checked before anything is built from it.

A trace is input from outside (a recording, another tool, a hand edit), so a
value that would misbehave later -- a NaN reward that fails only the PRM
methods' requests, a length of 10**12 that the simulator would try to decode,
a misspelt key that silently takes its default -- is refused here, with the
file and line it came from. The limits are far above any real run and far
below what would exhaust memory or time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

from sart.errors import ConfigError

#: ``sart.engines.scripts.DEFAULT_LOGPROB_EVERY`` (not imported: this module reads
#: lines only); a test checks that they agree.
DEFAULT_LOGPROB_EVERY = 16

#: The most tokens a prompt or a branch may have (16 Mi: far beyond any context window).
MAX_TOKENS = 1 << 24
#: The most branches one request may have.
MAX_BRANCHES = 4096
#: The latest arrival, in seconds (about 30 years): beyond it a float clock stops
#: advancing by a decode step's time.
MAX_ARRIVAL = 1e9
#: The longest id or answer, in characters.
MAX_TEXT = 1 << 16
#: The longest line, in bytes (read no further: a line is held in memory whole).
MAX_LINE_BYTES = 64 << 20
#: The lowest logprob and the highest token confidence a trace may hold (a recording
#: clamps to them: a token the model gave probability 0 has logprob -inf).
MIN_LOGPROB = -1e6
MAX_CONFIDENCE = 1e6

REQUEST_KEYS = frozenset(
    {"id", "arrival", "answer", "prompt_tokens", "interval", "max_tokens", "branches"}
)
BRANCH_KEYS = frozenset(
    {"length", "answer", "rewards", "final_reward", "logprobs", "confidences", "logprob_every"}
)
#: The key of a trace's optional first line, its replay settings:
#: ``{"replay": {"persistence": 0.0, "fork_model": null}}``.
HEADER_KEY = "replay"
REPLAY_KEYS = frozenset({"persistence", "fork_model"})
FORK_MODEL_KEYS = frozenset({"intercept", "slope"})
#: The largest intercept or slope a fork model may have (a logit far past certainty).
MAX_FORK_COEFFICIENT = 1e3


class TraceLineError(ConfigError):
    """A trace line that cannot be replayed; the message names ``file:line``."""


def request_fields(line: object, where: str) -> dict[str, Any]:
    """The checked fields of a request line (a decoded JSON value), ready for
    ``TraceRequest``; branches as dicts of ``BranchScript`` fields."""
    obj = _object(line, where, "the line", REQUEST_KEYS, required=("id", "arrival", "answer"))
    if "branches" not in obj:
        raise TraceLineError(f"{where}: the line has no 'branches'")
    branches = obj["branches"]
    if not isinstance(branches, list):
        raise TraceLineError(f"{where}: branches must be a list, not {_kind(branches)}")
    if not branches:
        raise TraceLineError(f"{where}: request {obj['id']!r} has no branches")
    if len(branches) > MAX_BRANCHES:
        raise TraceLineError(
            f"{where}: {len(branches)} branches; at most {MAX_BRANCHES} are replayed"
        )
    fields: dict[str, Any] = {
        "id": _text(obj["id"], where, "id"),
        "arrival": _number(obj["arrival"], where, "arrival", 0.0, MAX_ARRIVAL),
        "answer": _text(obj["answer"], where, "answer"),
        "branches": [_branch(b, f"{where}: branches[{j}]") for j, b in enumerate(branches)],
    }
    if obj.get("prompt_tokens") is not None:
        fields["prompt_tokens"] = _count(obj["prompt_tokens"], where, "prompt_tokens", 1)
    if obj.get("interval") is not None:
        fields["interval"] = _count(obj["interval"], where, "interval", 1)
    if obj.get("max_tokens") is not None:
        cap = fields["max_tokens"] = _count(obj["max_tokens"], where, "max_tokens", 1)
        longest = max(b["length"] for b in fields["branches"])
        # A branch longer than the cap it was generated under is a broken file.
        if longest > cap:
            raise TraceLineError(f"{where}: a branch of {longest} tokens under max_tokens={cap}")
    return fields


def is_header(line: object) -> bool:
    """Whether a decoded line is a replay header rather than a request."""
    return isinstance(line, dict) and HEADER_KEY in line


def header_fields(line: object, where: str) -> dict[str, Any]:
    """The checked replay settings of a header line: ``persistence`` (a share in
    [0, 1], or ``None``: estimate it from the trace) and ``fork_model`` (``None``:
    the request's own answers, or a dict of ``ForkModel`` fields), each only where
    the line says; what it leaves out keeps ``Trace``'s default."""
    keys = frozenset({HEADER_KEY})
    obj = _object(line, where, "the header line", keys, (HEADER_KEY,), "header line")
    settings = _object(obj[HEADER_KEY], where, HEADER_KEY, REPLAY_KEYS, (), "replay header")
    fields: dict[str, Any] = {}
    if "persistence" in settings:
        value = settings["persistence"]
        share = None if value is None else _number(value, where, "persistence", 0.0, 1.0)
        fields["persistence"] = share
    if "fork_model" in settings:
        model = settings["fork_model"]
        if model is None:
            fields["fork_model"] = None
        else:
            required = ("intercept", "slope")
            model = _object(model, where, "fork_model", FORK_MODEL_KEYS, required, "fork_model")
            bound = MAX_FORK_COEFFICIENT
            fields["fork_model"] = {
                key: _number(model[key], where, f"fork_model.{key}", -bound, bound)
                for key in ("intercept", "slope")
            }
    return fields


def _branch(value: object, where: str) -> dict[str, Any]:
    obj = _object(value, where, "a branch", BRANCH_KEYS, required=("length", "answer"))
    length = _count(obj["length"], where, "length", 1)
    rewards = obj.get("rewards", [])
    if not isinstance(rewards, list):
        raise TraceLineError(f"{where}: rewards must be a list, not {_kind(rewards)}")
    # One check per token at the very most: more rewards than tokens is a broken file.
    if len(rewards) > length:
        raise TraceLineError(
            f"{where}: {len(rewards)} rewards for a branch of {length} tokens "
            "(at most one per token)"
        )
    final = obj.get("final_reward")
    fields: dict[str, Any] = {
        "length": length,
        "answer": _text(obj["answer"], where, "answer", empty=True),
        "rewards": tuple(_reward(r, where, f"rewards[{i}]") for i, r in enumerate(rewards)),
        "final_reward": None if final is None else _reward(final, where, "final_reward"),
    }
    fields.update(_logprob_fields(obj, length, where))
    return fields


def _logprob_fields(obj: Mapping[str, Any], length: int, where: str) -> dict[str, Any]:
    """The optional per-segment logprobs and confidences (``BranchScript`` fields)."""
    fields: dict[str, Any] = {}
    every = obj.get("logprob_every")
    if every is not None:
        fields["logprob_every"] = every = _count(every, where, "logprob_every", 1)
    # One value per segment of the branch at the most, as for rewards.
    segments = -(-length // (every or DEFAULT_LOGPROB_EVERY))
    for name, low, high in (("logprobs", MIN_LOGPROB, 0.0), ("confidences", 0.0, MAX_CONFIDENCE)):
        values = obj.get(name)
        if values is None:
            continue
        if not isinstance(values, list):
            raise TraceLineError(f"{where}: {name} must be a list, not {_kind(values)}")
        if len(values) > segments:
            raise TraceLineError(
                f"{where}: {len(values)} {name} for a branch of {length} tokens in segments "
                f"of {every or DEFAULT_LOGPROB_EVERY} (at most one per segment)"
            )
        fields[name] = tuple(
            _number(v, where, f"{name}[{i}]", low, high) for i, v in enumerate(values)
        )
    return fields


def _object(
    value: object,
    where: str,
    what: str,
    keys: frozenset[str],
    required: tuple[str, ...],
    noun: str | None = None,
) -> Mapping[str, Any]:
    """``value`` as an object with only ``keys`` and every one of ``required``;
    ``noun`` names what has those keys in a message (by default a request or a branch)."""
    if not isinstance(value, dict):
        raise TraceLineError(f"{where}: {what} must be a JSON object, not {_kind(value)}")
    unknown = sorted(set(value) - keys)
    if unknown:
        # A misspelt optional key would otherwise take its default without a word.
        raise TraceLineError(
            f"{where}: unknown key {', '.join(map(repr, unknown))} "
            f"(a {noun or ('request' if keys is REQUEST_KEYS else 'branch')} has {sorted(keys)})"
        )
    for key in required:
        if key not in value:
            raise TraceLineError(f"{where}: {what} has no {key!r}")
    return value


def _number(value: object, where: str, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceLineError(f"{where}: {name} must be a number, not {_kind(value)}")
    number = float(value) if isinstance(value, float) or abs(value) < 1 << 1000 else math.inf
    if not (math.isfinite(number) and low <= number <= high):
        raise TraceLineError(f"{where}: {name}={_show(value)} must be in [{low:g}, {high:g}]")
    return number


def _reward(value: object, where: str, name: str) -> float:
    # NaN and values outside [0, 1] fail only the PRM methods' requests, at run time:
    # refused here so that every method replays the same trace.
    return _number(value, where, name, 0.0, 1.0)


def _count(value: object, where: str, name: str, low: int) -> int:
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral:
        raise TraceLineError(f"{where}: {name} must be a whole number, not {_show(value)}")
    count = int(cast(float, value))  # an int, or a float that is whole: checked above
    if not low <= count <= MAX_TOKENS:
        raise TraceLineError(f"{where}: {name}={_show(value)} must be in [{low}, {MAX_TOKENS}]")
    return count


def _text(value: object, where: str, name: str, *, empty: bool = False) -> str:
    """A string, or a number written without quotes (``"answer": 42``); ``empty``:
    ``""`` too (a branch that wrote no answer: cut at its token cap)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TraceLineError(f"{where}: {name} must be a string, not {_kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise TraceLineError(f"{where}: {name}={value!r} is not an answer")
    text = value if isinstance(value, str) else str(value)
    if (not text and not empty) or len(text) > MAX_TEXT:
        low = 0 if empty else 1
        raise TraceLineError(f"{where}: {name} must have {low} to {MAX_TEXT} characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON can spell a lone surrogate ("\ud800")
        raise TraceLineError(f"{where}: {name} is not valid Unicode text") from None
    return text


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false"}.get(
        type(value), "null" if value is None else "a number"
    )


def _show(value: object) -> str:
    """A value for a message, short even when the file's value is not."""
    text = f"{value:.6g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
