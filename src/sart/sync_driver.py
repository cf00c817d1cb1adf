"""``SyncDriver``: the loop of ``sart.driver`` performed by calling, and ``sart.run``.

The synchronous driver serves step-based engines (``sart.Engine``): each effect the
loop yields is carried out by a plain call; overlapped PRM checks run on worker
threads (``sart.score_runner``) and the loop waits on them only when it has nothing
else to do. ``sart.async_driver`` is the same loop performed by awaiting.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any

from sart.clock import Clock
from sart.commands import Score
from sart.driver import DriverBase, Effect, Outcome, Returned, _Call, _StartScore, advance
from sart.engines.base import Engine
from sart.prm.base import PRM
from sart.request import Request
from sart.results import RequestResult
from sart.score_runner import PendingScore
from sart.types import Admission, Scoring


class SyncDriver(DriverBase):
    """Runs requests through a ``Scheduler`` against a step-based engine and a PRM."""

    def run(self, requests: Iterable[Request] = ()) -> list[RequestResult]:
        """Submit ``requests``, run until everything submitted has finished, and
        return their results in submission order."""
        requests = self._submit_all(requests)
        try:
            while self.step():
                pass
        finally:
            self.close()
        return self._results_of(requests)

    def step(self) -> bool:
        """Carry out one batch of commands (or wait once); ``False`` when there is
        nothing left to do."""
        loop = self._step()
        effect = advance(loop, (None, None))
        while not isinstance(effect, Returned):
            effect = advance(loop, self._attempt(effect))
        return effect.more

    def _attempt(self, effect: Effect) -> Outcome:
        try:
            return self._perform(effect), None
        except Exception as exc:  # the loop turns it into a Failed event
            return None, exc

    def _perform(self, effect: Effect) -> Any:
        if isinstance(effect, _Call):
            return effect.fn(*effect.args)
        if isinstance(effect, _StartScore):
            return self._start_score(effect.command)
        self._wait(effect.until)
        return None

    def _start_score(self, command: Score) -> PendingScore:
        scores = self.scores
        if scores.virtual:
            return scores.price(command)
        if self.scoring is Scoring.BLOCKING:
            return scores.waited(command, scores.timed(command.items))
        return PendingScore(command, future=scores.executor().submit(scores.timed, command.items))

    def _wait(self, until: float | None) -> None:
        pending = self.scores.pending
        start = self.clock.now()
        if not pending:
            assert until is not None  # the loop waits only for an arrival or a Score
            self.clock.sleep_until(until)
            return
        if self.scores.virtual:
            ready = min(p.ready_at for p in pending)
            self.clock.sleep_until(ready if until is None else min(until, ready))
        else:
            timeout = None if until is None else max(0.0, until - start)
            futures = [p.future for p in pending]
            concurrent.futures.wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")
        self.scores.stalled(self.clock.now() - start)


def run(
    requests: Iterable[Request],
    engine: Engine,
    prm: PRM | None = None,
    *,
    batch_size: int = 64,
    admission: Admission | str = Admission.CHUNK,
    scoring: Scoring | str = Scoring.OVERLAPPED,
    aging: float | None = None,
    clock: Clock | None = None,
) -> list[RequestResult]:
    """Serve ``requests`` on ``engine`` with the synchronous driver; results in input order.

    ``scoring="blocking"`` runs Algorithm 1 as written (decoding waits for every
    PRM check); the default overlaps checks with decoding (see ``sart.Scoring``).
    Requests are admitted by ``Request.priority``, then arrival (``aging``: see
    ``SchedulerConfig.aging``)."""
    driver = SyncDriver(
        engine,
        prm,
        batch_size=batch_size,
        admission=admission,
        scoring=scoring,
        aging=aging,
        clock=clock,
    )
    return driver.run(requests)


__all__ = ["SyncDriver", "run"]
