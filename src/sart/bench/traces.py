"""Traces: what every branch of every request did, one request per JSONL line.

::

    {"id": "r0", "arrival": 12.5, "answer": "A", "prompt_tokens": 310, "interval": 400,
     "branches": [{"length": 3120, "answer": "A", "rewards": [0.61, 0.58], "final_reward": 0.66},
                  ...]}

``arrival`` is in seconds (time units under the ``steps`` cost model);
``answer`` is the gold answer; ``rewards[j]`` is the branch's PRM reward after
``(j+1) * T`` generated tokens and ``final_reward`` its reward once complete;
a branch whose ``length`` reaches ``max_tokens`` is truncated. Optional:
``prompt_tokens`` (default 256), ``interval``, the ``T`` the rewards were
recorded at (a replay uses it as its default ``T``), and ``max_tokens``, the
token cap the branches were generated under (a recording writes it, so that a
branch cut there is told apart from one that ended on its own). A branch may also
carry per-segment log-probabilities for confidence-based methods:
``logprobs`` (the sampled tokens' mean logprob) and ``confidences`` (their
mean token confidence) over segments of ``logprob_every`` tokens (default
16), as ``BranchScript`` has them.

A trace may start with a header line of replay settings, ``{"replay":
{"persistence": 0.0, "fork_model": null}}`` (``Trace.header``): how a fork's
child is drawn, which a generated preset sets and a recording from a real PRM
leaves to the defaults.

Every value is checked when a trace is read (``trace_lines``): a line that
cannot be replayed is refused with ``file:line`` before anything runs; see
``docs/reference/trace-format.md``.

A trace is replayed exactly by ``SimEngine`` + ``ScriptedPRM`` through
``Trace.script()``: branch ``j`` of request ``r`` is line ``r``'s ``branches[j]``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import attrs

from sart.bench.trace_forks import FITTED, ForkModel, TraceScript, reward_persistence
from sart.bench.trace_lines import (
    HEADER_KEY,
    MAX_LINE_BYTES,
    TraceLineError,
    header_fields,
    is_header,
    request_fields,
)
from sart.engines.scripts import DEFAULT_LOGPROB_EVERY, BranchScript
from sart.errors import ConfigError, config_check

__all__ = [
    "DEFAULT_PROMPT_TOKENS",
    "TRACE_SUFFIXES",
    "ForkModel",
    "Trace",
    "TraceRequest",
    "TraceScript",
    "is_trace_file",
    "reward_persistence",
]

DEFAULT_PROMPT_TOKENS = 256


@attrs.frozen
class TraceRequest:
    """One request of a trace."""

    id: str
    arrival: float
    answer: str
    """The gold answer."""
    branches: tuple[BranchScript, ...]
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    interval: int | None = None
    max_tokens: int | None = None
    """The token cap the branches were generated under (``None``: not recorded)."""

    def to_json(self) -> dict:
        line: dict = {
            "id": self.id,
            "arrival": self.arrival,
            "answer": self.answer,
            "prompt_tokens": self.prompt_tokens,
        }
        if self.interval is not None:
            line["interval"] = self.interval
        if self.max_tokens is not None:
            line["max_tokens"] = self.max_tokens
        line["branches"] = [_branch_json(b) for b in self.branches]
        return line

    @classmethod
    def from_json(cls, line: object, where: str = "trace") -> TraceRequest:
        """A request from one decoded JSON line; every value is checked first
        (see ``trace_lines``) and a bad one named with ``where``."""
        fields = request_fields(line, where)
        branches = tuple(BranchScript(filler="", **b) for b in fields.pop("branches"))
        return cls(branches=branches, **fields)


def _branch_json(b: BranchScript) -> dict:
    out: dict = {
        "length": b.length,
        "answer": b.answer,
        "rewards": [round(r, 4) for r in b.rewards],
    }
    if b.final_reward is not None:
        out["final_reward"] = round(b.final_reward, 4)
    if b.logprobs:
        out["logprobs"] = [round(x, 4) for x in b.logprobs]
    if b.confidences:
        out["confidences"] = [round(x, 4) for x in b.confidences]
    if b.logprobs or b.confidences or b.logprob_every != DEFAULT_LOGPROB_EVERY:
        out["logprob_every"] = b.logprob_every
    return out


@attrs.frozen
class Trace:
    """An ordered collection of trace requests."""

    requests: tuple[TraceRequest, ...]
    persistence: float | None = attrs.field(default=None, kw_only=True)
    """How much of a fork's parent's reward gap its child keeps (``TraceScript``);
    ``None``: read from the trace (``reward_persistence``), as for a trace recorded
    from a real PRM, whose rewards rate a prefix. The generated presets say 0: their
    rewards are noisy draws around each branch's own latent quality, not ratings of
    a prefix, and a child takes its source's."""

    fork_model: ForkModel | None = attrs.field(default=FITTED, kw_only=True)
    """Whether a fork's child is right (``TraceScript``): the ``ForkModel`` fitted to
    real forks, from its parent's reward, for a trace recorded from a real PRM; or
    ``None``, the request's own answers (the parent's with the share of it written,
    else a fresh branch's), for the generated presets: their rewards are not on a
    real PRM's scale, and the fitted model, blind to a request's difficulty, made
    right children of requests whose branches were almost all wrong."""

    @persistence.validator
    def _check_persistence(self, attribute: attrs.Attribute, value: float | None) -> None:
        config_check(value is None or 0.0 <= value <= 1.0, "persistence", value, "in [0, 1]")

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def width(self) -> int:
        """Branches available per request (the largest ``n`` a replay can use)."""
        return min(len(r.branches) for r in self.requests)

    @property
    def interval(self) -> int | None:
        """The ``T`` the rewards were recorded at, if every request says the same."""
        values = {r.interval for r in self.requests}
        return values.pop() if len(values) == 1 else None

    def script(self, every: int | None = None) -> TraceScript:
        """Branch behaviour for ``SimEngine``/``FakeEngine`` and ``ScriptedPRM``
        (share one between the engine and the PRM: forks are recorded in it).
        ``every``: the tokens between recorded rewards where a request does not say
        (its ``interval``); the PRM must read rewards at the same ``every``.
        Forks are drawn by ``fork_model`` (``TraceScript``)."""
        return TraceScript(self, every, self.fork_model, persistence=self.persistence)

    def gold(self) -> dict[str, str]:
        return {r.id: r.answer for r in self.requests}

    def header(self) -> dict | None:
        """The trace's replay header line (``{"replay": {...}}``), or ``None`` where
        its replay settings are the defaults (those of a trace recorded from a real
        PRM): the settings a generated preset chose travel with the file."""
        settings: dict = {}
        if self.persistence is not None:
            settings["persistence"] = self.persistence
        if self.fork_model != FITTED:
            model = self.fork_model
            settings["fork_model"] = None if model is None else attrs.asdict(model)
        return {HEADER_KEY: settings} if settings else None

    def dump(self, path: str | Path) -> None:
        """Write the trace as JSONL, its replay header first where it has one
        (``header``); gzip-compressed when ``path`` ends in ``.gz``."""
        opener = gzip.open if _gzipped(path) else open
        with opener(path, "wt", encoding="utf-8") as f:
            header = self.header()
            if header is not None:
                f.write(json.dumps(header, separators=(",", ":")) + "\n")
            for r in self.requests:
                f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a JSONL trace (gzip-compressed when ``path`` ends in ``.gz``), its
        replay settings from a header line where it has one (``header``); a line
        that cannot be replayed is refused with ``path:line`` and the reason, before
        anything runs."""
        requests: list[TraceRequest] = []
        lines: dict[str, int] = {}
        settings: dict | None = None
        try:
            f = _open(path)  # closed by the with below; decoded line by line
        except OSError as exc:
            raise ConfigError(f"trace={str(path)!r}: {exc.strerror}") from exc
        with f:
            try:
                for number, raw in enumerate(_lines(f), 1):
                    where = f"{path}:{number}"
                    line = _decode(raw, where)
                    if line is _BLANK:
                        continue
                    if is_header(line):
                        if requests or settings is not None:
                            raise TraceLineError(
                                f"{where}: a second header line; the header is the first line"
                                if settings is not None
                                else f"{where}: a header line after requests; it must be first"
                            )
                        settings = header_fields(line, where)
                        continue
                    request = TraceRequest.from_json(line, where)
                    if request.id in lines:
                        raise TraceLineError(
                            f"{where}: the id {request.id!r} is already line {lines[request.id]}'s"
                        )
                    lines[request.id] = number
                    requests.append(request)
            except (gzip.BadGzipFile, EOFError) as exc:
                raise ConfigError(f"trace={str(path)!r}: not a whole gzip file ({exc})") from exc
        settings = settings or {}
        if settings.get("fork_model") is not None:
            settings["fork_model"] = ForkModel(**settings["fork_model"])
        return cls.of(requests, where=str(path), **settings)

    @classmethod
    def of(
        cls,
        requests: Iterable[TraceRequest],
        where: str = "trace",
        *,
        persistence: float | None = None,
        fork_model: ForkModel | None = FITTED,
    ) -> Trace:
        requests = tuple(requests)
        if not requests:
            raise ConfigError(f"{where}: the trace has no requests")
        seen: set[str] = set()
        for number, r in enumerate(requests, 1):
            if r.id in seen:
                raise ConfigError(f"{where}: request {number} repeats the id {r.id!r}")
            seen.add(r.id)
        return cls(requests, persistence=persistence, fork_model=fork_model)


#: The names a trace file may have: JSONL, or JSONL compressed with gzip.
TRACE_SUFFIXES = (".jsonl", ".jsonl.gz")


def is_trace_file(name: str | None) -> bool:
    """Whether ``name`` (a ``--workload`` or ``--trace`` value) names a trace file."""
    return bool(name) and str(name).endswith(TRACE_SUFFIXES)


def _gzipped(path: str | Path) -> bool:
    """Whether the trace file at ``path`` is (to be) gzip-compressed: by its name."""
    return str(path).endswith(".gz")


def _open(path: str | Path) -> gzip.GzipFile | BinaryIO:
    return gzip.GzipFile(path, "rb") if _gzipped(path) else open(path, "rb")


def _lines(f: gzip.GzipFile | BinaryIO) -> Iterator[bytes | None]:
    """The file's lines, ``None`` for one longer than ``MAX_LINE_BYTES`` (not read
    further than that: a line is held in memory whole)."""
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            yield None
            return
        yield raw


#: ``_decode``'s value for a blank line (``None`` is a line's JSON ``null``).
_BLANK = object()


def _decode(raw: bytes | None, where: str) -> object:
    """One line's JSON value, ``_BLANK`` for a blank line."""
    if raw is None:
        raise TraceLineError(f"{where}: a line longer than {MAX_LINE_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceLineError(f"{where}: not UTF-8 text (byte {exc.start + 1})") from None
    if not text.strip():
        return _BLANK
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceLineError(f"{where}: not JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit number; [[[[...]]]]
        raise TraceLineError(f"{where}: not a trace line ({exc.__class__.__name__})") from None
    return line
