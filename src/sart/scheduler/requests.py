"""The requests in flight: how each one's check runs, and how each one ends.

A request ends exactly once -- completed with an answer (``finalise``), failed or
cancelled (``end_unfinished``) -- and ending it stops its running branches
(their slots freed, one ``Abort``), marks its waiting ones so they never start,
releases its prefix and emits its ``Finish``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sart.commands import Abort, Command, Finish, Refusal, ReleasePrefix, StartBranches
from sart.results import RequestResult
from sart.scheduler import algorithm
from sart.scheduler.checks import Check
from sart.scheduler.hooks import PolicyFailure
from sart.scheduler.slots import Slots
from sart.scheduler.waiting import WaitQueue
from sart.state import BranchState, RequestState
from sart.types import BranchId, BranchStatus, RequestStatus
from sart.views import Load


class RequestTable:
    """Open requests (submitted, and prefilled), the decode step, and the outbox the
    commands their checks and endings emit go to."""

    def __init__(self, slots: Slots, waiting: WaitQueue) -> None:
        self.pending: dict[str, RequestState] = {}  # submitted, not finished
        self.active: dict[str, RequestState] = {}  # prefilled (or prefilling), not finished
        self.outbox: list[Command] = []
        self.step = 0  # decode steps run so far
        self.finished = 0
        self._slots = slots
        self._waiting = waiting
        # The scheduler's measure of the load, shown to each request's check.
        self.load_of: Callable[[RequestState, float], Load] | None = None

    def run_checks(self, checks: Sequence[Check], now: float) -> None:
        for check in checks:
            if check.req.ended:
                continue
            if self.load_of is not None:
                check.req.load = self.load_of(check.req, now)
            try:
                self._check(check, now)
            except PolicyFailure as exc:
                self.fail(check.req, str(exc), now)

    def _check(self, check: Check, now: float) -> None:
        """One request's check (``algorithm``'s docstring maps it to the paper)."""
        req = check.req
        algorithm.count_completions(req, check.ended)
        view = None
        if algorithm.prune_due(req, check.due, check.ended):
            victims, view = algorithm.choose_prunes(req)
            if victims:
                for branch in victims:
                    self.end_running(req, branch, BranchStatus.PRUNED)
                req.num_pruned += len(victims)
                self.outbox.append(Abort(tuple(b.id for b in victims)))
                if req.policy.prune.forks:
                    self._fork(req, algorithm.prune_forks(req, view, len(victims)))
                view = req.view()
        if algorithm.should_finish(req, view):
            self._finalise(req, now)
        elif req.policy.rebranch.active:
            self._fork(req, algorithm.rebranch_forks(req, self._slots.free()))

    def _fork(self, req: RequestState, children: Sequence[BranchState]) -> None:
        if children:
            self.outbox.append(self._slots.fork(req.id, children))

    def _drop_pending_forks(self, req: RequestState) -> None:
        """``req`` ends: the forks its checks asked for and the engine has not started yet
        (their ``StartBranches`` still in the outbox) are never started. Left there, the
        engine would start them after the request's aborts and prefix release."""
        kept: list[Command] = []
        for cmd in self.outbox:
            if isinstance(cmd, StartBranches) and cmd.request_id == req.id:
                self._slots.unreserve([BranchId(req.id, spec.index) for spec in cmd.branches])
            else:
                kept.append(cmd)
        self.outbox[:] = kept

    def _finalise(self, req: RequestState, now: float) -> None:
        chosen, answer_of = algorithm.choose_answer(req)
        self._end_branches(req, BranchStatus.STOPPED)
        self._close(req, algorithm.completed_result(req, chosen, answer_of, now), now)

    def fail(
        self,
        req: RequestState,
        reason: str,
        now: float,
        refusal: Refusal | None = None,
    ) -> None:
        self.end_unfinished(req, RequestStatus.FAILED, reason, now, refusal)

    def end_unfinished(
        self,
        req: RequestState,
        status: RequestStatus,
        reason: str,
        now: float,
        refusal: Refusal | None = None,
    ) -> None:
        """End ``req`` without an answer (failed or cancelled; ``refusal``: the engine
        refused it): abort its running branches; the waiting ones never start."""
        if req.ended:
            return
        self._end_branches(req, BranchStatus.FAILED)
        result = algorithm.unfinished_result(req, status, reason, now, refusal)
        self._close(req, result, now)

    def _end_branches(self, req: RequestState, status: BranchStatus) -> None:
        """End every branch of ``req`` not ended yet with ``status``: the running ones
        aborted (their slots freed), the others (waiting, paused: no KV) just marked;
        forks asked for but not started are dropped."""
        self._drop_pending_forks(req)
        aborted = []
        for branch in req.branches:
            if branch.status is BranchStatus.RUNNING:
                self.end_running(req, branch, status)
                aborted.append(branch.id)
            elif not branch.status.is_ended:
                branch.status = status
        if aborted:
            self.outbox.append(Abort(tuple(aborted)))

    def end_running(
        self, req: RequestState, branch: BranchState, status: BranchStatus, step: int | None = None
    ) -> None:
        """End a running branch of ``req`` at ``step`` (default: now) and free its slot."""
        self._slots.end(req, branch, status, self.step if step is None else step)
        if not status.is_completed:
            branch.logprobs = None  # never chosen: what it kept goes with its KV

    def _close(self, req: RequestState, result: RequestResult, now: float) -> None:
        req.ended = True
        req.finished_at = now
        req.newly_ended = []
        if req.prefilled:
            self.outbox.append(ReleasePrefix(req.id))
        self.outbox.append(Finish(result))
        del self.pending[req.id]
        self._waiting.forget(req, queued=req.scheduled_at is None)
        self.active.pop(req.id, None)
        self.finished += 1
