"""Algorithm 1's two queues of waiting work, and the order admission takes it in.

``request_queue`` holds requests not prefilled yet; ``branch_queue`` holds
branches of prefilled requests that have no batch slot (and branches paused for
more urgent work). Each free slot goes to the most *urgent* waiting item: a
request's urgency is its priority (lower first), less one level per ``aging``
it has waited; a waiting branch has its request's. In a tie a waiting branch
goes first (as Algorithm 1: fill from the branch queue, then prefill), then the
earlier in its queue.

With one priority level among the requests not finished, every item is as
urgent as every other (aging moves each request by the time since its arrival,
and admission order is arrival order), so the most urgent item is simply the
front of the branch queue, else of the request queue: FCFS, in O(1). With
several levels each pick scans the queues.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from sart.request import Request
from sart.state import BranchState, RequestState
from sart.types import BranchStatus

T = TypeVar("T")

#: What admission takes next: a request to prefill, or a waiting branch (with its request).
Waiting = RequestState | tuple[RequestState, BranchState]


class WaitQueue:
    """The request and branch queues, and the priority levels of open requests."""

    def __init__(self, aging: float | None) -> None:
        self.aging = aging
        self._requests: deque[RequestState] = deque()
        self._branches: deque[tuple[RequestState, BranchState]] = deque()
        # Priorities of the requests submitted and not finished: with one level, FCFS.
        self._levels: Counter[int] = Counter()

    # ------------------------------------------------------------------ contents

    def add_request(self, req: RequestState) -> None:
        self._requests.append(req)
        self._levels[req.request.priority] += 1

    def add_branches(self, req: RequestState, branches: Iterable[BranchState]) -> None:
        self._branches.extend((req, b) for b in branches)

    def forget(self, req: RequestState, queued: bool) -> None:
        """``req`` ended (``queued``: before it was prefilled); its waiting branches are
        ended too and dropped when next met."""
        if queued:
            self._requests.remove(req)
        self._levels[req.request.priority] -= 1
        if not self._levels[req.request.priority]:
            del self._levels[req.request.priority]

    @property
    def several_levels(self) -> bool:
        return len(self._levels) > 1

    @property
    def queued_requests(self) -> int:
        return len(self._requests)

    @property
    def queued_branches(self) -> int:
        return sum(1 for _, b in self._branches if b.status is BranchStatus.WAITING)

    def __bool__(self) -> bool:
        """Whether any request or branch waits."""
        return bool(self._requests) or self.queued_branches > 0

    # ----------------------------------------------------------------- admission

    def urgency(self, request: Request, now: float) -> int:
        """A request's effective priority now (lower first): its own, less one level
        per ``aging`` it has waited."""
        if self.aging is None:
            return request.priority
        return request.priority - math.floor(max(0.0, now - request.arrival) / self.aging)

    def pop(self, now: float) -> Waiting | None:
        """The most urgent waiting item, taken off its queue (``None``: nothing waits)."""
        waiting = BranchStatus.WAITING
        if not self.several_levels:
            while self._branches and self._branches[0][1].status is not waiting:
                self._branches.popleft()  # its request ended while it waited
            if self._branches:
                return self._branches.popleft()
            return self._requests.popleft() if self._requests else None
        self._branches = deque(entry for entry in self._branches if entry[1].status is waiting)
        branch_at, branch_key = _first_min(
            self._branches, lambda entry: self.urgency(entry[0].request, now)
        )
        request_at, request_key = _first_min(
            self._requests, lambda req: self.urgency(req.request, now)
        )
        if branch_at is not None and (request_at is None or branch_key <= request_key):
            entry = self._branches[branch_at]
            del self._branches[branch_at]
            return entry
        if request_at is None:
            return None
        req = self._requests[request_at]
        del self._requests[request_at]
        return req

    def pause_quota(self, now: float, active: Iterable[RequestState]) -> dict[str, int]:
        """How many running branches to pause, by request, for more urgent waiting work.

        The waiting work, most urgent first (a waiting branch needs one slot, a waiting
        request ``n``), takes branches from running requests strictly less urgent than
        it, the least urgent first (then the latest to arrive), each keeping one branch
        running; so no more are paused than that work can use, and a request is never
        paused for one as urgent as itself (no two requests take turns)."""

        def urgency(req: RequestState) -> int:
            return self.urgency(req.request, now)

        wanted: list[tuple[int, int]] = [  # (urgency, slots wanted)
            (urgency(req), 1) for req, b in self._branches if b.status is BranchStatus.WAITING
        ]
        wanted += [(urgency(req), req.n) for req in self._requests]
        wanted.sort(key=lambda w: w[0])
        donors = sorted(
            (req for req in active if req.running > 1 and not req.ended),
            key=lambda req: (-urgency(req), -req.request.arrival),
        )
        spare = {req.id: req.running - 1 for req in donors}
        taken: dict[str, int] = {}
        for level, slots in wanted:
            for req in donors:
                if slots == 0 or urgency(req) <= level:
                    break  # donors are sorted: the rest are as urgent or more
                give = min(slots, spare[req.id])
                spare[req.id] -= give
                taken[req.id] = taken.get(req.id, 0) + give
                slots -= give
        return {rid: count for rid, count in taken.items() if count}


def _first_min(items: Sequence[T], key: Callable[[T], int]) -> tuple[int | None, int]:
    """The index of the first item with the smallest key, and that key (``None``, 0
    if there is none)."""
    best: int | None = None
    best_key = 0
    for i, item in enumerate(items):
        k = key(item)
        if best is None or k < best_key:
            best, best_key = i, k
    return best, best_key
