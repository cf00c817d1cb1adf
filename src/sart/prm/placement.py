"""Which PRM worker scores a request: sticky, least-loaded placement for PRM pools.

A PRM pool (``sart.prm.process.PRMPool``: processes; ``sart.prm.remote.RemotePRM``:
servers) keeps a cache per request on the worker that scored it (the question's
prefix, each branch's scored tokens), so every check of a request must go to the
same worker. ``Placement`` places a request, at its first check, on the worker
with the fewest requests placed (ties: the lowest index), keeps it there until
``release``, and leaves a worker marked down out of new placements for a while
(its requests are placed again at their next check). Thread-safe; pure Python.

``fan_out`` sends one call to each worker a batch of requests is placed on, side by
side, and sorts out what came back: the pools differ only in what a call is.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

import attrs

from sart.errors import PRMError

__all__ = ["FanOut", "Placement", "fan_out"]

T = TypeVar("T")


class Placement:
    """Sticky, least-loaded placement of requests on ``workers`` workers."""

    def __init__(
        self, workers: int, *, cooldown: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.workers = workers
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._placed: dict[str, int] = {}
        self._down_until = [float("-inf")] * workers

    def of(self, request_id: str) -> int:
        """The worker of ``request_id``: where it was placed, or (placing it now) the
        least-loaded worker that is up (every worker, if none is)."""
        with self._lock:
            now = self._clock()
            placed = self._placed.get(request_id)
            if placed is not None and self._down_until[placed] <= now:
                return placed
            up = [w for w in range(self.workers) if self._down_until[w] <= now]
            load = [0] * self.workers
            for worker in self._placed.values():
                load[worker] += 1
            worker = min(up or range(self.workers), key=lambda w: (load[w], w))
            self._placed[request_id] = worker
            return worker

    def split(self, request_ids: Iterable[str]) -> dict[int, list[int]]:
        """Positions of ``request_ids`` grouped by their worker (placing new ones)."""
        groups: dict[int, list[int]] = {}
        for position, rid in enumerate(request_ids):
            groups.setdefault(self.of(rid), []).append(position)
        return groups

    def placed(self, request_id: str) -> int | None:
        with self._lock:
            return self._placed.get(request_id)

    def release(self, request_id: str) -> int | None:
        """Forget ``request_id``; the worker it was on (``None``: not placed)."""
        with self._lock:
            return self._placed.pop(request_id, None)

    def mark_down(self, worker: int) -> None:
        """Leave ``worker`` out of placements for ``cooldown`` seconds; its requests are
        placed again at their next check."""
        with self._lock:
            self._down_until[worker] = self._clock() + self.cooldown
            for rid in [r for r, w in self._placed.items() if w == worker]:
                del self._placed[rid]

    def load(self) -> list[int]:
        """Requests placed on each worker."""
        with self._lock:
            counts = [0] * self.workers
            for worker in self._placed.values():
                counts[worker] += 1
            return counts


@attrs.frozen
class FanOut(Generic[T]):
    """What the workers of one ``fan_out`` answered."""

    held: dict[int, list[int]]
    """Worker -> the positions (in the call's ``request_ids``) it was sent."""
    answers: dict[int, T]
    """Worker -> its answer, for the workers that answered."""
    failed: dict[str, str]
    """Request id -> why, for the requests of workers that raised a ``PRMError`` (the
    requests it names, or every request the worker held)."""
    unattributed: Exception | None = None
    """An error that names no request (a bug, not a worker's failure): re-raise it."""

    def raise_failures(self) -> None:
        """Raise the unattributed error, else one ``PRMError`` naming the failed requests."""
        if self.unattributed is not None:
            raise self.unattributed
        if self.failed:
            raise PRMError("; ".join(sorted(set(self.failed.values()))), sorted(self.failed))


def fan_out(
    placement: Placement,
    pool: concurrent.futures.Executor,
    request_ids: Sequence[str],
    call: Callable[[int, list[int]], T],
    *,
    mark_down: bool = False,
) -> FanOut[T]:
    """``call(worker, positions)`` on ``pool`` for each worker the requests are placed
    on, all at once; each worker's answer or failure. ``mark_down``: a worker that
    fails is left out of placements for the placement's cooldown."""
    held = placement.split(request_ids)
    calls = {worker: pool.submit(call, worker, positions) for worker, positions in held.items()}
    answers: dict[int, T] = {}
    failed: dict[str, str] = {}
    unattributed: Exception | None = None
    for worker, future in calls.items():
        try:
            answers[worker] = future.result()
        except PRMError as exc:
            if mark_down:
                placement.mark_down(worker)
            named = set(exc.request_ids) or {request_ids[k] for k in held[worker]}
            for rid in named:
                failed.setdefault(rid, str(exc))
        except Exception as exc:
            unattributed = exc
    return FanOut(held, answers, failed, unattributed)
