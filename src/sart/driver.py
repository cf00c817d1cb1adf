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
from sart.engines.base import Engine, engine_clock, supports_fork
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


class SyncDriver:
    """Runs requests through a ``Scheduler`` against a step-based engine and a PRM.

    ``clock`` defaults to the engine's own virtual clock if it has one, else
    the wall clock. ``on_result`` is called with each result as it is
    finished.
    """

    def __init__(
        self,
        engine: Engine,
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

    def run(self, requests: Iterable[Request] = ()) -> list[RequestResult]:
        """Submit ``requests``, run until everything submitted has finished, and
        return their results in submission order."""
        requests = list(requests)
        for request in requests:
            self.submit(request)
        while self.step():
            pass
        by_id = {r.request_id: r for r in self.results}
        return [by_id[r.id] for r in requests]

    def step(self) -> bool:
        """Carry out one batch of commands; ``False`` when there is nothing left to do."""
        now = self.clock.now()
        while self._arrivals and self._arrivals[0][0] <= now:
            self.scheduler.submit(heapq.heappop(self._arrivals)[2])
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
            if ids & failed:
                events.append(Skipped())
                continue
            try:
                event = self._perform(cmd)
            except AssertionError:
                raise
            except EngineError as exc:
                event = Failed(str(exc), exc.request_ids or None)
            except Exception as exc:
                event = Failed(f"{type(exc).__name__}: {exc}")
            if isinstance(event, Failed):
                failed |= ids
            events.append(event)
        return events

    def _perform(self, cmd: Command) -> Event:
        engine = self.engine
        if isinstance(cmd, Decode):
            output = engine.step(cmd.max_steps, until_first_end=cmd.until_first_end)
            stats = engine.stats()
            self.timeline.append(
                TimelineSample(self.clock.now(), stats.live_branches, stats.kv_tokens)
            )
            return Decoded(output)
        if isinstance(cmd, Score):
            return self._score(cmd.items)
        if isinstance(cmd, Prefill):
            req = cmd.request
            return Prefilled(engine.prefill(req.id, req.prompt, req.sampling))
        if isinstance(cmd, StartBranches):
            engine.start_branches(cmd.request_id, cmd.branches)
            return Started()
        if isinstance(cmd, Abort):
            engine.abort(cmd.branches)
            return Done()
        if isinstance(cmd, ReleasePrefix):
            engine.release_prefix(cmd.request_id)
            release = getattr(self.prm, "release", None)
            if release is not None:
                release(cmd.request_id)
            return Done()
        if isinstance(cmd, Finish):
            self.results.append(cmd.result)
            if self._on_result is not None:
                self._on_result(cmd.result)
            return Done()
        raise TypeError(f"unknown command {cmd!r}")

    def _score(self, items: Sequence[ScoreItem]) -> Scored:
        groups: dict[str, list[ScoreItem]] = {}
        for item in items:
            groups.setdefault(item.branch.request_id, []).append(item)
        rewards: dict[BranchId, float] = {}
        failures: dict[str, str] = {}
        self._score_groups(list(groups.items()), rewards, failures)
        return Scored(rewards=rewards, failures=failures)

    def _score_groups(
        self,
        groups: list[tuple[str, list[ScoreItem]]],
        rewards: dict[BranchId, float],
        failures: dict[str, str],
    ) -> None:
        """Score all groups in one PRM call; on failure, confine it to the requests at fault."""
        assert self.prm is not None  # submit() refuses requests that need one
        batch = [item for _, group in groups for item in group]
        try:
            values = list(self.prm.score(batch))
            if len(values) != len(batch):
                raise PRMError(f"PRM returned {len(values)} rewards for {len(batch)} items")
        except AssertionError:
            raise
        except PRMError as exc:
            named = [g for g in groups if g[0] in exc.request_ids]
            if not named:
                self._isolate(groups, rewards, failures, exc)
                return
            for rid, _ in named:
                failures[rid] = str(exc)
            rest = [g for g in groups if g[0] not in exc.request_ids]
            if rest:
                self._score_groups(rest, rewards, failures)
            return
        except Exception as exc:
            self._isolate(groups, rewards, failures, exc)
            return
        rewards.update(zip((item.branch for item in batch), values))

    def _isolate(
        self,
        groups: list[tuple[str, list[ScoreItem]]],
        rewards: dict[BranchId, float],
        failures: dict[str, str],
        exc: Exception,
    ) -> None:
        # A failure we cannot attribute: retry request by request so that only
        # the request at fault fails. Costs extra PRM calls only on failure.
        if len(groups) == 1:
            failures[groups[0][0]] = f"{type(exc).__name__}: {exc}"
            return
        for group in groups:
            self._score_groups([group], rewards, failures)


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
