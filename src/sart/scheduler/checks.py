"""The check queue: which requests' checks run now, which wait for PRM rewards,
and how scoring interleaves with decoding -- blocking or overlapped, decided here
and nowhere else.

A request *wants* a check after a decode chunk in which one of its branches
ended or its interval ``T`` came due. Taking the check snapshots what it
processes (the branches that ended since its last check, and whether pruning is
due) and starts a new interval. A check whose policy needs rewards sends its
snapshot's ``ScoreItem``s in a ``Score``; the others run at once.

* ``Scoring.BLOCKING`` (Algorithm 1 as written): every wanting check is taken
  together; if any needs rewards they all wait for one ``Score``, and nothing
  else runs until it is answered.
* ``Scoring.OVERLAPPED``: decoding goes on while up to ``max_scores`` (``K``)
  ``Score`` commands are in flight, each with its own checks; a request has at
  most one check in flight, and a check that needs rewards while ``K`` are in
  flight stays wanted (its snapshot is taken when a worker is free: fresher
  rewards). Decode chunks are cut to ``poll_steps`` meanwhile, so rewards are
  applied soon after they arrive.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import attrs

from sart.commands import Score
from sart.messages import ScoreItem
from sart.scheduler.algorithm import may_prune
from sart.scheduler.config import SchedulerConfig
from sart.state import BranchState, RequestState
from sart.types import BranchStatus, Scoring


@attrs.define
class Check:
    """One request's check: the branches that ended since its last check (this
    check processes them), and whether pruning was due when it was taken."""

    req: RequestState
    ended: list[BranchState]
    due: bool


def is_due(req: RequestState) -> bool:
    return req.steps_since_check >= req.policy.interval


def take(req: RequestState) -> Check:
    """Start ``req``'s check: the branches it processes and its due interval are its own now."""
    check = Check(req, req.newly_ended, is_due(req))
    if check.due:
        req.steps_since_check = 0
    req.newly_ended = []
    return check


def score_items(check: Check) -> list[ScoreItem]:
    """What ``check`` needs scored: its completed branches (final rewards, for
    selection) and, when it may prune, every running branch of its request."""
    req, policy = check.req, check.req.policy
    branches: list[BranchState] = []
    if policy.scores_completed:
        branches.extend(b for b in check.ended if b.status.is_completed)
    if check.due and policy.scores_running and (policy.rescores or may_prune(req, check.ended)):
        branches.extend(b for b in req.branches if b.status is BranchStatus.RUNNING)
    return [
        ScoreItem(
            branch=b.id,
            prompt=req.request.prompt,
            text=b.text,
            num_tokens=b.num_tokens,
            final=b.status.is_completed,
        )
        for b in branches
    ]


class CheckQueue:
    """Wanted checks, and the checks waiting for each ``Score`` (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.blocking = config.scoring is Scoring.BLOCKING
        self.max_scores = config.max_scores
        self.poll_steps = config.poll_steps
        # The checks waiting for the rewards of each Score in flight (by its id), and of
        # those still in the outbox (in the order they were queued: they get ids so).
        self.in_flight: dict[int, list[Check]] = {}
        self._queued: deque[list[Check]] = deque()
        self._wanted: dict[str, RequestState] = {}

    @property
    def waiting(self) -> int:
        """Requests whose wanted check waits for a ``Score`` slot (overlapped scoring)."""
        return sum(not req.ended for req in self._wanted.values())

    def want(self, reqs: Iterable[RequestState]) -> None:
        """``reqs`` want a check (those with one in flight get theirs after it)."""
        self._wanted.update((req.id, req) for req in reqs if not req.in_score)

    def flush(self) -> tuple[Score | None, list[Check]]:
        """Take the wanted checks that can be taken now: the ``Score`` to send for
        those that need rewards (``None``: none), and those to run at once."""
        wanted = [req for req in self._wanted.values() if not req.ended]
        if self.blocking:
            self._wanted.clear()
            checks = [take(req) for req in wanted]
            items = [item for check in checks for item in score_items(check)]
            if items:  # every check waits for the rewards, as in Algorithm 1
                return self._send(checks, items), []
            return None, checks
        busy = len(self.in_flight) + len(self._queued) >= self.max_scores
        self._wanted = {rid: req for rid, req in self._wanted.items() if not req.ended}
        sent: list[Check] = []
        items = []
        ready: list[Check] = []
        for req in wanted:
            wants = score_items(Check(req, req.newly_ended, is_due(req)))
            if wants and busy:
                continue  # its snapshot is taken when the PRM is free: fresher rewards
            del self._wanted[req.id]
            (sent if wants else ready).append(take(req))
            items.extend(wants)
        return (self._send(sent, items) if sent else None), ready

    def _send(self, checks: list[Check], items: list[ScoreItem]) -> Score:
        by_id = {check.req.id: check.req for check in checks}
        for check in checks:
            check.req.in_score = True
        for item in items:
            by_id[item.branch.request_id].prm_items += 1
        self._queued.append(checks)
        return Score(tuple(items))

    def sent(self, score_id: int) -> None:
        """The oldest ``Score`` from ``flush`` was emitted with id ``score_id``."""
        self.in_flight[score_id] = self._queued.popleft()

    def answered(self, score_id: int) -> list[Check]:
        """The checks whose rewards the ``Score`` ``score_id`` brought."""
        checks = self.in_flight.pop(score_id)
        for check in checks:
            check.req.in_score = False
        return checks

    def decode_steps(self, running: list[RequestState]) -> int:
        """The next decode chunk: until the next request's check is due (with one
        policy, ``T`` steps)."""
        if not self.in_flight:
            return min(req.policy.interval - req.steps_since_check for req in running)
        # A check that waits for the PRM cannot run sooner by decoding less; the
        # others bound the chunk, and so does the Score in flight, so that its
        # rewards are applied within ``poll`` steps of arriving.
        poll = self.poll_steps or max(1, min(r.policy.interval for r in running) // 8)
        waiting = [
            req.policy.interval - req.steps_since_check
            for req in running
            if req.id not in self._wanted and not req.in_score
        ]
        return min([poll, *waiting])
