"""Cancellations the scheduler owes: asked for by the caller (``Scheduler.cancel``)
or due by a request's deadline. Both are applied together at the next
``next_commands``, when no command of the request but an overlapped ``Score`` is
in flight."""

from __future__ import annotations

import heapq
import itertools

from sart.state import RequestState


class Cancellations:
    """Cancels asked for, and the deadlines of open requests (earliest first)."""

    def __init__(self) -> None:
        self._asked: dict[str, str] = {}  # request id -> reason, in the order asked
        # (deadline, order, request) of requests with a timeout; ended ones dropped lazily.
        self._deadlines: list[tuple[float, int, RequestState]] = []
        self._order = itertools.count()

    def watch(self, req: RequestState) -> None:
        """Cancel ``req`` at its deadline, if it has one and has not ended by then."""
        if req.request.deadline is not None:
            heapq.heappush(self._deadlines, (req.request.deadline, next(self._order), req))

    def ask(self, request_id: str, reason: str) -> None:
        self._asked.setdefault(request_id, reason)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request not ended yet."""
        while self._deadlines and self._deadlines[0][2].ended:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def take(self, now: float) -> dict[str, str]:
        """The cancels to apply now, by request id: those asked for, and those whose
        deadline has come."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if not req.ended:
                reason = f"timed out: not finished within timeout={req.request.timeout:g}"
                self.ask(req.id, reason)
        asked, self._asked = self._asked, {}
        return asked
