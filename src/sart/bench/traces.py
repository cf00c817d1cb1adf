"""Traces: what every branch of every request did, one request per JSONL line.

::

    {"id": "r0", "arrival": 12.5, "answer": "A", "prompt_tokens": 310, "interval": 400,
     "branches": [{"length": 3120, "answer": "A", "rewards": [0.61, 0.58], "final_reward": 0.66},
                  ...]}

``arrival`` is in seconds (time units under the ``steps`` cost model);
``answer`` is the gold answer; ``rewards[j]`` is the branch's PRM reward after
``(j+1) * T`` generated tokens and ``final_reward`` its reward once complete;
a branch whose ``length`` reaches ``max_tokens`` is truncated. Optional:
``prompt_tokens`` (default 256) and ``interval``, the ``T`` the rewards were
recorded at (a replay uses it as its default ``T``).

A trace is replayed exactly by ``SimEngine`` + ``ScriptedPRM`` through
``Trace.script()``: branch ``j`` of request ``r`` is line ``r``'s ``branches[j]``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import attrs

from sart.engines.scripts import BranchScript
from sart.errors import ConfigError
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

    def to_json(self) -> dict:
        line: dict = {
            "id": self.id,
            "arrival": self.arrival,
            "answer": self.answer,
            "prompt_tokens": self.prompt_tokens,
        }
        if self.interval is not None:
            line["interval"] = self.interval
        line["branches"] = [_branch_json(b) for b in self.branches]
        return line

    @classmethod
    def from_json(cls, line: dict, where: str = "trace") -> TraceRequest:
        try:
            branches = tuple(
                BranchScript(
                    length=int(b["length"]),
                    answer=str(b["answer"]),
                    rewards=tuple(float(r) for r in b.get("rewards", ())),
                    final_reward=None
                    if b.get("final_reward") is None
                    else float(b["final_reward"]),
                    filler="",
                )
                for b in line["branches"]
            )
            request = cls(
                id=str(line["id"]),
                arrival=float(line["arrival"]),
                answer=str(line["answer"]),
                branches=branches,
                prompt_tokens=int(line.get("prompt_tokens", DEFAULT_PROMPT_TOKENS)),
                interval=None if line.get("interval") is None else int(line["interval"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: not a trace request ({exc!r})") from exc
        if not branches:
            raise ConfigError(f"{where}: request {request.id!r} has no branches")
        if not math.isfinite(request.arrival) or request.arrival < 0:
            raise ConfigError(f"{where}: arrival={request.arrival!r} must be >= 0")
        return request


def _branch_json(b: BranchScript) -> dict:
    out: dict = {
        "length": b.length,
        "answer": b.answer,
        "rewards": [round(r, 4) for r in b.rewards],
    }
    if b.final_reward is not None:
        out["final_reward"] = round(b.final_reward, 4)
    return out


@attrs.frozen
class Trace:
    """An ordered collection of trace requests."""

    requests: tuple[TraceRequest, ...]

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

    def script(self, keep: float = 0.7) -> TraceScript:
        """Branch behaviour for ``SimEngine``/``FakeEngine`` and ``ScriptedPRM``
        (share one between the engine and the PRM: forks are recorded in it)."""
        return TraceScript(self, keep)

    def gold(self) -> dict[str, str]:
        return {r.id: r.answer for r in self.requests}

    def dump(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for r in self.requests:
                f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        requests = []
        try:
            f = open(path, encoding="utf-8")  # closed by the with below
        except OSError as exc:
            raise ConfigError(f"trace={str(path)!r}: {exc.strerror}") from exc
        with f:
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    line = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{where}: not JSON ({exc.msg})") from exc
                requests.append(TraceRequest.from_json(line, where))
        return cls.of(requests, where=str(path))

    @classmethod
    def of(cls, requests: Iterable[TraceRequest], where: str = "trace") -> Trace:
        requests = tuple(requests)
        if not requests:
            raise ConfigError(f"{where}: the trace has no requests")
        seen: set[str] = set()
        for number, r in enumerate(requests, 1):
            if r.id in seen:
                raise ConfigError(f"{where}: request {number} repeats the id {r.id!r}")
            seen.add(r.id)
        return cls(requests)


class TraceScript:
    """Looks branches up in a trace, and draws continuations for forked branches.

    A fork of branch ``p`` at ``position`` tokens (Rebase) continues like
    another branch of the same request that was still running at that length:
    with probability ``keep`` one that has ``p``'s answer (a continuation
    mostly keeps its direction), else any; if no branch ran that long, the
    longest. The child takes that branch's answer, its remaining length and
    its rewards by token count. The draw is seeded by the child's id, so a
    replay is deterministic.
    """

    def __init__(self, trace: Trace, keep: float = 0.7) -> None:
        self._table = {r.id: r.branches for r in trace.requests}
        self._keep = keep
        self._forks: dict[BranchId, BranchScript] = {}

    def __call__(self, branch: BranchId) -> BranchScript:
        forked = self._forks.get(branch)
        if forked is not None:
            return forked
        return self._table[branch.request_id][branch.index]

    def fork(self, child: BranchId, parent: BranchId, position: int) -> BranchScript:
        branches = self._table[child.request_id]
        parent_answer = self(parent).answer
        rng = random.Random(f"{child.request_id}/{child.index}/{position}")
        alive = [b for b in branches if b.length > position] or [
            max(branches, key=lambda b: b.length)
        ]
        same = [b for b in alive if b.answer == parent_answer]
        pool = same if same and rng.random() < self._keep else alive
        source = pool[rng.randrange(len(pool))]
        script = attrs.evolve(source, length=max(source.length, position + 1))
        self._forks[child] = script
        return script


def replay_requests(trace: Trace | Sequence[TraceRequest]) -> list[TraceRequest]:
    """Trace requests in arrival order (stable for ties)."""
    return sorted(trace, key=lambda r: r.arrival)
