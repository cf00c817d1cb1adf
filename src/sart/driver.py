"""The synchronous driver: the one loop that carries out the scheduler's commands.

It owns the effects the scheduler only decides: calling the engine and the
PRM, reading the clock, releasing requests at their arrival times, and
collecting results and the resource timeline. Engine and PRM exceptions are
turned into ``Failed`` events for the requests they affect; an
``AssertionError`` (a bug, e.g. ``EngineMisuse`` from the fake engine) is
let through.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from sart.clock import Clock, WallClock
from sart.commands import (
    Abort,
    Command,
    Decode,
    Decoded,
    Done,
    Event,
    Failed,
    Finish,
    Prefill,
    Prefilled,
    ReleasePrefix,
    Score,
    Scored,
    Skipped,
    StartBranches,
    Started,
)
from sart.engines.base import Engine, StepOutput, engine_clock, supports_fork
from sart.errors import ConfigError, EngineError, PRMError
from sart.prm.base import PRM, ScoreItem
from sart.request import Request
from sart.results import RequestResult
from sart.scheduler import Scheduler, SchedulerConfig
from sart.types import Admission, BranchId


@attrs.frozen
class TimelineSample:
    """Resource use right after one decode call (the paper's Figure 3)."""

    time: float
    running_branches: int
    kv_tokens: int


class DriverBase:
    """What the synchronous and the asyncio drivers share: intake, the mapping from
    commands to engine/PRM calls and back to events, and result bookkeeping.

    ``clock`` defaults to the engine's own virtual clock if it has one, else
    the wall clock. ``on_result`` is called with each result as it is
    finished.
    """

    def __init__(
        self,
        engine: Any,
        prm: PRM | None = None,
        *,
        batch_size: int,
        admission: Admission | str = Admission.CHUNK,
        clock: Clock | None = None,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> None:
        self.engine = engine
        self.prm = prm
        self.clock: Clock = clock or engine_clock(engine) or WallClock()
        self.scheduler = Scheduler(SchedulerConfig(batch_size=batch_size, admission=admission))
        self.results: list[RequestResult] = []
        """Results in the order requests finished."""
        self.timeline: list[TimelineSample] = []
        self._on_result = on_result
        self._arrivals: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()

    def submit(self, request: Request) -> None:
        """Queue a request; it reaches the scheduler at ``request.arrival``."""
        policy = request.policy
        if self.prm is None and (policy.scores_running or policy.scores_completed):
            raise ConfigError(
                f"prm=None but request {request.id!r} uses policy {policy.name!r}, which needs "
                "PRM rewards; pass a PRM to the driver"
            )
        if policy.prune.forks and not supports_fork(self.engine):
            raise ConfigError(
                f"request {request.id!r} uses policy {policy.name!r}, which forks branches; "
                f"{type(self.engine).__name__} does not support forking"
            )
        heapq.heappush(self._arrivals, (request.arrival, next(self._seq), request))

    def _admit_arrivals(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] <= now:
            self.scheduler.submit(heapq.heappop(self._arrivals)[2])

    def _results_of(self, requests: Sequence[Request]) -> list[RequestResult]:
        by_id = {r.request_id: r for r in self.results}
        return [by_id[r.id] for r in requests]

    def _effect(
        self, cmd: Command
    ) -> tuple[Callable[..., Any] | None, tuple[Any, ...], Callable[[Any], Event]]:
        """The call a command needs (``None``: none), its arguments, and how its
        return value becomes the event. Sync or async, the engine is called the
        same way; only whether the driver awaits differs."""
        engine = self.engine
        if isinstance(cmd, Decode):
            return engine.step, (cmd.max_steps, cmd.until_first_end), self._decoded
        if isinstance(cmd, Score):
            return self._score, (cmd.items,), lambda scored: scored
        if isinstance(cmd, Prefill):
            req = cmd.request
            return engine.prefill, (req.id, req.prompt, req.sampling), Prefilled
        if isinstance(cmd, StartBranches):
            return engine.start_branches, (cmd.request_id, cmd.branches), lambda _: Started()
        if isinstance(cmd, Abort):
            return engine.abort, (cmd.branches,), lambda _: Done()
        if isinstance(cmd, ReleasePrefix):
            return (
                engine.release_prefix,
                (cmd.request_id,),
                lambda _: self._released(cmd.request_id),
            )
        if isinstance(cmd, Finish):
            return None, (), lambda _: self._finished(cmd.result)
        raise TypeError(f"unknown command {cmd!r}")

    @staticmethod
    def _failure(exc: Exception) -> Failed:
        if isinstance(exc, EngineError):
            return Failed(str(exc), exc.request_ids or None)
        return Failed(f"{type(exc).__name__}: {exc}")

    def _decoded(self, output: StepOutput) -> Decoded:
        stats = self.engine.stats()
        self.timeline.append(TimelineSample(self.clock.now(), stats.live_branches, stats.kv_tokens))
        return Decoded(output)

    def _released(self, request_id: str) -> Done:
        release = getattr(self.prm, "release", None)
        if release is not None:
            release(request_id)
        return Done()

    def _finished(self, result: RequestResult) -> Done:
        self.results.append(result)
        if self._on_result is not None:
            self._on_result(result)
        return Done()

    def _score(self, items: Sequence[ScoreItem]) -> Scored:
        assert self.prm is not None  # submit() refuses requests that need one
        return score_items(self.prm, items)


class SyncDriver(DriverBase):
    """Runs requests through a ``Scheduler`` against a step-based engine and a PRM."""

    def run(self, requests: Iterable[Request] = ()) -> list[RequestResult]:
        """Submit ``requests``, run until everything submitted has finished, and
        return their results in submission order."""
        requests = list(requests)
        for request in requests:
            self.submit(request)
        while self.step():
            pass
        return self._results_of(requests)

    def step(self) -> bool:
        """Carry out one batch of commands; ``False`` when there is nothing left to do."""
        now = self.clock.now()
        self._admit_arrivals(now)
        cmds = self.scheduler.next_commands(now)
        if not cmds:
            if self._arrivals:
                self.clock.sleep_until(self._arrivals[0][0])
                return True
            return False
        events = self._execute(cmds)
        self.scheduler.handle(events, self.clock.now())
        return True

    # ------------------------------------------------------------------ effects

    def _execute(self, cmds: Sequence[Command]) -> list[Event]:
        events: list[Event] = []
        failed: set[str] = set()
        for cmd in cmds:
            ids = cmd.request_ids if isinstance(cmd, (Prefill, StartBranches)) else frozenset()
            if ids & failed:  # an earlier command of this request failed
                events.append(Skipped())
                continue
            fn, args, to_event = self._effect(cmd)
            try:
                event = to_event(fn(*args) if fn is not None else None)
            except AssertionError:
                raise
            except Exception as exc:
                event = self._failure(exc)
            if isinstance(event, Failed):
                failed |= ids
            events.append(event)
        return events


def score_items(prm: PRM, items: Sequence[ScoreItem]) -> Scored:
    """Score ``items`` in one PRM call; on failure, confine it to the requests at fault
    (``PRMError.request_ids``, else by retrying request by request)."""
    groups: dict[str, list[ScoreItem]] = {}
    for item in items:
        groups.setdefault(item.branch.request_id, []).append(item)
    rewards: dict[BranchId, float] = {}
    failures: dict[str, str] = {}
    _score_groups(prm, list(groups.items()), rewards, failures)
    return Scored(rewards=rewards, failures=failures)


def _score_groups(
    prm: PRM,
    groups: list[tuple[str, list[ScoreItem]]],
    rewards: dict[BranchId, float],
    failures: dict[str, str],
) -> None:
    batch = [item for _, group in groups for item in group]
    try:
        values = list(prm.score(batch))
        if len(values) != len(batch):
            raise PRMError(f"PRM returned {len(values)} rewards for {len(batch)} items")
    except AssertionError:
        raise
    except PRMError as exc:
        named = [g for g in groups if g[0] in exc.request_ids]
        if not named:
            _isolate(prm, groups, rewards, failures, exc)
            return
        for rid, _ in named:
            failures[rid] = str(exc)
        rest = [g for g in groups if g[0] not in exc.request_ids]
        if rest:
            _score_groups(prm, rest, rewards, failures)
        return
    except Exception as exc:
        _isolate(prm, groups, rewards, failures, exc)
        return
    rewards.update(zip((item.branch for item in batch), values))


def _isolate(
    prm: PRM,
    groups: list[tuple[str, list[ScoreItem]]],
    rewards: dict[BranchId, float],
    failures: dict[str, str],
    exc: Exception,
) -> None:
    # A failure we cannot attribute: retry request by request so that only the
    # request at fault fails. Costs extra PRM calls only on failure.
    if len(groups) == 1:
        failures[groups[0][0]] = f"{type(exc).__name__}: {exc}"
        return
    for group in groups:
        _score_groups(prm, [group], rewards, failures)


def run(
    requests: Iterable[Request],
    engine: Engine,
    prm: PRM | None = None,
    *,
    batch_size: int = 64,
    admission: Admission | str = Admission.CHUNK,
    clock: Clock | None = None,
) -> list[RequestResult]:
    """Serve ``requests`` on ``engine`` with the synchronous driver; results in input order."""
    driver = SyncDriver(engine, prm, batch_size=batch_size, admission=admission, clock=clock)
    return driver.run(requests)
