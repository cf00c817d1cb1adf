"""Carrying out the scheduler's ``Score`` commands for a driver, and the PRM time they cost.

A ``Score`` runs where the clock says:

- with a virtual clock (the fake and simulated engines) it is computed at
  once, deterministically, and takes the time the PRM's cost model gives
  (``PricedPRM.cost``; zero for any other PRM): blocking, or on a PRM that
  shares the engine's accelerator, the clock advances by it; overlapped on
  its own accelerator, the rewards are delivered once the clock has passed
  it, while decoding goes on. A priced PRM with ``replicas`` serves that many
  calls at once; more wait for a free replica (``price``);
- with the wall clock, blocking checks call the PRM and wait; overlapped
  checks run it on worker threads (``executor``: ``max_scores`` of them) while
  the loop keeps decoding, and its rewards are handed to the scheduler at the
  first step after it finishes (``collect``).

``release`` calls to a one-worker PRM wait until no call is in flight (a plain
PRM never sees two threads). PRM time is charged per request: ``prm_seconds``
(PRM time spent on its items) and ``prm_wait_seconds`` (time its running
branches stood still waiting for the PRM); ``prm_busy`` and ``prm_wait`` are
the run's totals.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

from sart.clock import Clock
from sart.commands import Score, Scored
from sart.messages import ScoreItem
from sart.prm.base import PRM, PricedPRM
from sart.rewards.isolation import prm_replicas, prm_workers
from sart.rewards.router import RewardRouter
from sart.types import Scoring


class PendingScore:
    """A ``Score`` being carried out: done at ``ready_at`` on a virtual clock, or when
    its worker's future is."""

    def __init__(
        self,
        command: Score,
        *,
        outcome: tuple[Scored, float] | None = None,
        ready_at: float = float("-inf"),
        future: Any = None,
    ) -> None:
        self.command = command
        self.ready_at = ready_at
        self.future = future
        self._outcome = outcome

    def done(self, clock: Clock) -> bool:
        if self._outcome is not None:
            return clock.now() >= self.ready_at
        return bool(self.future.done())

    def outcome(self) -> tuple[Scored, float]:
        """The rewards and the PRM's busy seconds."""
        return self._outcome if self._outcome is not None else self.future.result()


class ScoreRunner:
    """The ``Score`` commands a driver has in flight, how each runs, and PRM time."""

    def __init__(
        self,
        rewards: RewardRouter,
        prm: PRM | None,
        clock: Clock,
        *,
        scoring: Scoring,
        max_scores: int,
        running: Callable[[], list[str]],
        open_requests: set[str],
    ) -> None:
        self.rewards = rewards
        self.prm = prm
        self.clock = clock
        self.scoring = scoring
        self.max_scores = max_scores
        self._running = running  # the requests a stalled decode delays
        self._open = open_requests  # the driver's: results not delivered yet
        # A virtual clock is one that can be advanced: scores are priced, not timed.
        self.virtual = callable(getattr(clock, "advance", None))
        # Checked once: a runtime Protocol's isinstance walks its members every call.
        self._priced: PricedPRM | None = prm if isinstance(prm, PricedPRM) else None
        self.pending: list[PendingScore] = []  # in flight, in the order started
        self.prm_busy = 0.0
        self.prm_wait = 0.0
        # A one-worker PRM is called from one thread at a time; a pool takes its calls
        # (releases included) from any thread.
        self._threadsafe = prm_workers(prm) > 1
        self._free_at = [float("-inf")] * prm_replicas(prm)  # virtual clock, per replica
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._releases: list[str] = []  # held back while Scores are in flight
        self._busy_of: dict[str, float] = {}
        self._wait_of: dict[str, float] = {}

    # ------------------------------------------------------------------ running

    def price(self, command: Score) -> PendingScore:
        """A Score on a virtual clock: computed now, delivered after its modelled cost.
        Only the driver's PRM is priced: a policy's own reward source (confidence from
        log-probabilities) costs no model call."""
        source_of = self.rewards.source_of
        priced = [i for i in command.items if source_of(i.branch.request_id) is self.prm]
        cost = self._priced.cost(priced) if self._priced is not None and priced else 0.0
        scored = self.rewards.score(command.items)
        now = self.clock.now()
        shared = self._priced is not None and self._priced.shares_engine and bool(priced)
        if self.scoring is Scoring.BLOCKING or shared:
            self.clock.advance(cost)  # type: ignore[attr-defined]
            self.stalled(cost)
            return PendingScore(command, outcome=(scored, cost))
        # The PRM's replicas serve calls side by side; a call waits for the first free.
        free = self._free_at
        replica = min(range(len(free)), key=free.__getitem__)
        ready = max(now, free[replica]) + cost
        free[replica] = ready
        return PendingScore(command, outcome=(scored, cost), ready_at=ready)

    def timed(self, items: Sequence[ScoreItem]) -> tuple[Scored, float]:
        """Score ``items`` now (on this thread) and the seconds it took."""
        start = time.monotonic()
        scored = self.rewards.score(items)
        return scored, time.monotonic() - start

    def waited(self, command: Score, outcome: tuple[Scored, float]) -> PendingScore:
        """A blocking Score answered after the loop waited ``outcome``'s seconds for it."""
        self.stalled(outcome[1])
        return PendingScore(command, outcome=outcome)

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The worker threads overlapped Scores run on (``max_scores`` of them)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self.max_scores, "sart-prm")
        return self._executor

    def collect(self, handle: Callable[[int, Scored], None]) -> None:
        """Hand the rewards of finished Scores to ``handle`` (command id, rewards): on a
        virtual clock in the order they became ready, so a run is deterministic."""
        done = [pending for pending in self.pending if pending.done(self.clock)]
        if not done:
            return
        done.sort(key=lambda pending: (pending.ready_at, pending.command.id))
        for pending in done:
            self.pending.remove(pending)
            scored, busy = pending.outcome()
            self._account_busy(pending.command.items, busy)
            handle(pending.command.id, scored)
        if not self.pending:
            releases, self._releases = self._releases, []
            for request_id in releases:
                self.rewards.release(request_id)

    def release(self, request_id: str) -> None:
        """The engine let go of ``request_id``: so does its reward source (later, if the
        PRM takes one call at a time and one is in flight)."""
        if self.pending and not self._threadsafe:
            self._releases.append(request_id)  # the PRM may be busy on another thread
        else:
            self.rewards.release(request_id)

    def close(self) -> None:
        """Stop the worker threads, if any were started (a later run starts others)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ PRM time

    def stalled(self, seconds: float) -> None:
        """``seconds`` of decoding lost to the PRM, charged to the requests it held up."""
        running = self._running()
        if seconds <= 0 or not running:
            return
        self.prm_wait += seconds
        for rid in running:
            self._wait_of[rid] = self._wait_of.get(rid, 0.0) + seconds

    def _account_busy(self, items: Sequence[ScoreItem], seconds: float) -> None:
        self.prm_busy += seconds
        if not items:
            return
        share = seconds / len(items)
        for item in items:
            rid = item.branch.request_id
            if rid in self._open:  # not finished while it was scored
                self._busy_of[rid] = self._busy_of.get(rid, 0.0) + share

    def charges(self, request_id: str) -> tuple[float, float]:
        """A finished request's PRM seconds and PRM wait seconds (forgotten here)."""
        return self._busy_of.pop(request_id, 0.0), self._wait_of.pop(request_id, 0.0)
