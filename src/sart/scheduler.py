"""The SART scheduler: Algorithm 1 of the paper as a pure, deterministic state machine.

It decides and never acts: ``next_commands(now)`` returns the commands a
driver must carry out (prefill, start branches, decode, score, abort, release
a prefix, finish a request) and ``handle(events, now)`` takes one event per
command. It performs no I/O and imports no engine, so the same code runs
under the fake engine in property tests and under vLLM in production.

One cycle, for a batch budget ``B`` (branches)::

    admit   fill free slots from the branch queue, then prefill the next
            request (FCFS), whose ``n`` branches join the branch queue
    decode  every running branch, for up to ``T`` steps
    score   (if a policy needs it) completed branches, and running branches
            of requests whose check is due
    check   per request: phase change at the first completion, count
            completions, prune, and finish the request when its stop rule
            says so or when no branch is left; finishing stops the rest
            of its branches, releases their KV and then the shared prefix.

With ``Admission.TOKEN`` a decode returns as soon as any branch ends, so its
slot is refilled at the next step; pruning still happens every ``T`` steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs

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
from sart.engines.base import BranchSpec
from sart.errors import ConfigError, PRMError, SchedulerError, config_check
from sart.prm.base import ScoreItem, validate_reward
from sart.request import Request
from sart.results import RequestResult
from sart.state import BranchState, RequestMeta, RequestState
from sart.types import Admission, BranchId, BranchStatus, FinishReason, Phase, RequestStatus
from sart.views import Limits, RequestView

T = TypeVar("T")


def _check_batch_size(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    config_check(isinstance(value, int) and value >= 1, "batch_size", value, ">= 1")


@attrs.frozen
class SchedulerConfig:
    """Settings of the scheduler (per-request settings live in each request's ``Policy``)."""

    batch_size: int = attrs.field(validator=_check_batch_size)
    """``B``: the most branches decoding at once."""
    admission: Admission = attrs.field(default=Admission.CHUNK, converter=Admission)
    """When freed slots are refilled: between chunks (Algorithm 1) or at the next step."""


@attrs.frozen
class SchedulerStats:
    """A snapshot of the scheduler's queues and counters."""

    step: int
    """Decode steps run so far."""
    queued_requests: int
    queued_branches: int
    running_branches: int
    active_requests: int
    """Prefilled and not finished."""
    finished_requests: int
    failed_cleanups: int
    """Abort/release commands the engine failed to carry out."""


class _PolicyFailure(Exception):
    """A policy hook raised or returned something unusable; fails one request."""


class Scheduler:
    """Algorithm 1 over many requests. See the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._request_queue: deque[RequestState] = deque()
        self._branch_queue: deque[BranchState] = deque()
        self._pending: dict[str, RequestState] = {}  # submitted, not finished
        self._active: dict[str, RequestState] = {}  # prefilled (or prefilling), not finished
        self._running: dict[BranchId, BranchState] = {}
        self._reserved: set[BranchId] = set()  # start commands in flight
        self._step = 0
        self._outbox: list[Command] = []
        self._inflight: list[Command] | None = None
        self._checks: list[tuple[RequestState, bool]] = []
        self._finished = 0
        self._failed_cleanups = 0

    # ------------------------------------------------------------------ intake

    def submit(self, request: Request) -> None:
        """Queue a request that has arrived (FCFS in submission order)."""
        if request.id in self._pending:
            raise ConfigError(f"id={request.id!r} must be unique among requests in flight")
        state = RequestState(request)
        self._pending[request.id] = state
        self._request_queue.append(state)

    @property
    def idle(self) -> bool:
        """Nothing queued, running or left to emit."""
        return not self._pending and not self._outbox and self._inflight is None

    def meta(self, request_id: str) -> RequestMeta:
        """The paper's metadata record of a request that has not finished."""
        return self._pending[request_id].meta()

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            step=self._step,
            queued_requests=len(self._request_queue),
            queued_branches=sum(1 for b in self._branch_queue if b.status is BranchStatus.WAITING),
            running_branches=len(self._running),
            active_requests=len(self._active),
            finished_requests=self._finished,
            failed_cleanups=self._failed_cleanups,
        )

    # ---------------------------------------------------------------- decide

    def next_commands(self, now: float) -> list[Command]:
        """Commands to carry out now; empty when there is nothing to do until a request arrives."""
        if self._inflight is not None:
            raise SchedulerError("handle() the events of the previous commands first")
        if self._outbox:
            cmds, self._outbox = self._outbox, []
        else:
            cmds = self._admit(now)
            if not cmds and self._running:
                cmds = [self._decode_command()]
        self._inflight = cmds or None
        return cmds

    def _admit(self, now: float) -> list[Command]:
        free = self.config.batch_size - len(self._running) - len(self._reserved)
        if free <= 0:
            return []
        starts: dict[str, list[BranchState]] = {}
        while free > 0 and self._branch_queue:
            branch = self._branch_queue.popleft()
            if branch.status is not BranchStatus.WAITING:
                continue  # its request ended while it waited
            starts.setdefault(branch.id.request_id, []).append(branch)
            free -= 1
        cmds: list[Command] = [self._start(rid, branches) for rid, branches in starts.items()]
        while free > 0 and self._request_queue:
            req = self._request_queue.popleft()
            req.scheduled_at = now
            try:  # before the engine holds anything for it, so failing costs nothing
                req.limits = self._limits(self._call(req.policy.prune.start, req.n), "start")
            except _PolicyFailure as exc:
                self._fail(req, str(exc), now)
                continue
            self._active[req.id] = req
            cmds.append(Prefill(req.request))
            take = req.branches[: min(req.n, free)]
            cmds.append(self._start(req.id, take))
            free -= len(take)
        return cmds

    def _start(self, request_id: str, branches: Sequence[BranchState]) -> StartBranches:
        self._reserved.update(b.id for b in branches)
        specs = tuple(BranchSpec(index=b.index, seed=b.seed) for b in branches)
        return StartBranches(request_id=request_id, branches=specs)

    def _decode_command(self) -> Decode:
        # Decode until the next request's check is due; with one policy that is T steps.
        steps = min(
            req.policy.interval - req.steps_since_check
            for req in self._active.values()
            if req.running
        )
        return Decode(
            max_steps=max(1, steps), until_first_end=self.config.admission is Admission.TOKEN
        )

    # ----------------------------------------------------------------- apply

    def handle(self, events: Sequence[Event], now: float) -> None:
        """Apply the events answering the last ``next_commands`` (one per command, in order)."""
        cmds = self._inflight
        if cmds is None:
            raise SchedulerError("handle() called with no commands in flight")
        if len(events) != len(cmds):
            raise SchedulerError(f"{len(cmds)} commands were answered by {len(events)} events")
        self._inflight = None
        for cmd, event in zip(cmds, events):
            if isinstance(cmd, Prefill):
                self._on_prefill(cmd, event, now)
            elif isinstance(cmd, StartBranches):
                self._on_start(cmd, event, now)
            elif isinstance(cmd, Decode):
                self._on_decode(event, now)
            elif isinstance(cmd, Score):
                self._on_score(event, now)
            elif isinstance(event, Failed):  # Abort, ReleasePrefix, Finish
                self._failed_cleanups += 1
            elif not isinstance(event, Done):
                raise SchedulerError(f"{type(cmd).__name__} answered by {event!r}")

    def _on_prefill(self, cmd: Prefill, event: Event, now: float) -> None:
        req = self._active[cmd.request.id]
        if isinstance(event, Prefilled):
            req.prefilled = True
            self._branch_queue.extend(b for b in req.branches if b.id not in self._reserved)
        elif isinstance(event, Failed):
            self._fail(req, f"prefill failed: {event.reason}", now)
        else:
            raise SchedulerError(f"Prefill answered by {event!r}")

    def _on_start(self, cmd: StartBranches, event: Event, now: float) -> None:
        ids = [BranchId(cmd.request_id, spec.index) for spec in cmd.branches]
        self._reserved.difference_update(ids)
        req = self._pending.get(cmd.request_id)
        if req is None or req.ended:
            if isinstance(event, Started):  # a driver that did not skip: undo at once
                self._outbox.append(Abort(tuple(ids)))
            return
        if isinstance(event, Started):
            for bid in ids:
                branch = req.branches[bid.index]
                branch.status = BranchStatus.RUNNING
                self._running[bid] = branch
            req.running += len(ids)
        elif isinstance(event, Failed):
            self._fail(req, f"starting branches failed: {event.reason}", now)
        elif isinstance(event, Skipped):
            self._fail(req, "start skipped after an earlier failure", now)
        else:
            raise SchedulerError(f"StartBranches answered by {event!r}")

    def _on_decode(self, event: Event, now: float) -> None:
        if isinstance(event, Failed):
            involved = [r for r in self._active.values() if r.running]
            for req in involved:
                if event.request_ids is None or req.id in event.request_ids:
                    self._fail(req, f"decode failed: {event.reason}", now)
            return
        if not isinstance(event, Decoded):
            raise SchedulerError(f"Decode answered by {event!r}")
        out = event.output
        first_step = self._step
        self._step += out.steps
        for req in self._active.values():
            if req.running:
                req.steps_since_check += out.steps
        for bid, delta in out.deltas.items():
            branch = self._running.get(bid)
            if branch is None:
                raise SchedulerError(f"engine reported branch {bid} which is not running")
            branch.num_tokens += delta.new_tokens
            if delta.text:
                branch.chunks.append(delta.text)
            if delta.finish is not None:
                req = self._active[bid.request_id]
                branch.status = (
                    BranchStatus.FINISHED
                    if delta.finish is FinishReason.STOP
                    else BranchStatus.TRUNCATED
                )
                branch.end_step = first_step + (delta.end_offset or out.steps)
                branch.ended_in = req.phase
                del self._running[bid]
                req.running -= 1
                req.newly_ended.append(branch)
        if not self._running and self.config.admission is Admission.CHUNK:
            # Every branch ended before T steps: Algorithm 1 checks every request
            # after each Decode call, and the next Decode runs a full T steps.
            for req in self._active.values():
                req.steps_since_check = 0
        self._checks = [
            (req, req.steps_since_check >= req.policy.interval)
            for req in self._active.values()
            if req.newly_ended or req.steps_since_check >= req.policy.interval
        ]
        items = [item for req, due in self._checks for item in self._score_items(req, due)]
        if items:
            self._outbox.append(Score(tuple(items)))
        else:
            self._run_checks(now)

    def _score_items(self, req: RequestState, due: bool) -> list[ScoreItem]:
        policy = req.policy
        branches: list[BranchState] = []
        if policy.scores_completed:
            branches.extend(b for b in req.newly_ended if b.status.is_completed)
        if due and policy.scores_running and self._may_prune(req):
            branches.extend(b for b in req.branches if b.status is BranchStatus.RUNNING)
        req.prm_items += len(branches)
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

    @staticmethod
    def _may_prune(req: RequestState) -> bool:
        """Whether this check could prune: the budget is not spent, or the phase is
        about to change (a first completion), which may raise it."""
        if req.phase is Phase.EXPLORE and any(b.status.is_completed for b in req.newly_ended):
            return True
        return min(req.limits.max_num_pruned, len(req.branches) - 1) > req.num_pruned

    def _on_score(self, event: Event, now: float) -> None:
        if not isinstance(event, Scored):
            raise SchedulerError(f"Score answered by {event!r}")
        for request_id, reason in event.failures.items():
            req = self._pending.get(request_id)
            if req is not None:
                self._fail(req, f"PRM failed: {reason}", now)
        for bid, value in event.rewards.items():
            req = self._pending.get(bid.request_id)
            if req is None or req.ended:
                continue
            try:
                branch = req.branches[bid.index]
                branch.reward = validate_reward(value, bid)
                branch.reward_history.append((branch.num_tokens, branch.reward))
            except PRMError as exc:
                self._fail(req, str(exc), now)
        self._run_checks(now)

    # ----------------------------------------------------------------- check

    def _run_checks(self, now: float) -> None:
        checks, self._checks = self._checks, []
        for req, due in checks:
            if req.ended:
                continue
            try:
                self._check(req, due, now)
            except _PolicyFailure as exc:
                self._fail(req, str(exc), now)

    def _check(self, req: RequestState, due: bool, now: float) -> None:
        completed = [b for b in req.newly_ended if b.status.is_completed]
        req.newly_ended = []
        prune = req.policy.prune
        if completed and req.phase is Phase.EXPLORE:
            req.phase = Phase.EXPLOIT
            first = min(completed, key=lambda b: (b.end_step, b.index))
            req.limits = self._limits(
                self._call(prune.enter_exploit, req.limits, first.view(), req.n), "enter_exploit"
            )
        req.num_completed += len(completed)
        view = None
        if due:
            req.steps_since_check = 0
            if prune.active and req.running and self._may_prune(req):
                view = self._prune(req)
        if not req.running and not req.has_waiting():
            self._finalise(req, now)
        elif req.num_completed and self._call(req.policy.stop.should_stop, view or req.view()):
            # Stop rules are consulted only once a branch has completed, so a
            # finished request always has an answer.
            self._finalise(req, now)

    def _prune(self, req: RequestState) -> RequestView:
        """Apply the prune rule; return the request's view after pruning."""
        rule = req.policy.prune
        view = req.view()
        chosen = self._call(
            lambda v: list(rule.choose(v)), view, name=f"{type(rule).__name__}.choose"
        )
        budget = min(req.limits.max_num_pruned, len(req.branches) - 1) - req.num_pruned
        # Every choice is checked, not only those within the budget, so a bad rule
        # fails the same way whatever the budget.
        victims: list[BranchState] = []
        for index in chosen:
            if not isinstance(index, int) or not 0 <= index < len(req.branches):
                raise _PolicyFailure(f"prune rule chose {index!r}, not a branch index")
            branch = req.branches[index]
            if branch.status is not BranchStatus.RUNNING or branch in victims:
                raise _PolicyFailure(f"prune rule chose branch {index}, which is not running")
            victims.append(branch)
        del victims[max(budget, 0) :]
        for branch in victims:
            self._end_running(branch, req, BranchStatus.PRUNED)
        if victims:
            req.num_pruned += len(victims)
            self._outbox.append(Abort(tuple(b.id for b in victims)))
            if rule.forks:
                self._fork(req, view, len(victims))
        return req.view() if victims else view

    def _fork(self, req: RequestState, view: RequestView, slots: int) -> None:
        """Start the children the rule asks for, in the ``slots`` its prunes just freed
        (so a fork never takes a batch slot from another request)."""
        rule = req.policy.prune
        wanted = self._call(lambda v: dict(rule.fork(v)), view, name=f"{type(rule).__name__}.fork")
        children: list[BranchState] = []
        specs: list[BranchSpec] = []
        for index, count in sorted(wanted.items()):
            if not isinstance(index, int) or not 0 <= index < len(req.branches):
                raise _PolicyFailure(f"fork rule chose {index!r}, not a branch index")
            parent = req.branches[index]
            if parent.status is not BranchStatus.RUNNING:
                raise _PolicyFailure(f"fork rule chose branch {index}, which is not running")
            if not isinstance(count, int) or count < 0:
                raise _PolicyFailure(f"fork rule asked for {count!r} children of branch {index}")
            for _ in range(count):
                child = BranchState(
                    BranchId(req.id, len(req.branches)), req.request.seed + len(req.branches)
                )
                # The child starts where its parent is: same tokens, same last reward.
                child.num_tokens = parent.num_tokens
                child.chunks = [parent.text] if parent.num_tokens else []
                child.reward = parent.reward
                req.branches.append(child)
                children.append(child)
                specs.append(BranchSpec(index=child.index, seed=child.seed, parent=index))
        if len(children) > slots:
            raise _PolicyFailure(
                f"fork rule asked for {len(children)} new branches; pruning freed {slots} slots"
            )
        if children:
            self._reserved.update(c.id for c in children)
            self._outbox.append(StartBranches(request_id=req.id, branches=tuple(specs)))

    def _finalise(self, req: RequestState, now: float) -> None:
        candidates = [b for b in req.branches if b.status.is_completed]
        if not candidates:
            raise _PolicyFailure("no branch completed")
        policy = req.policy
        answers = [self._call(policy.extract, b.text) for b in candidates]
        if not all(isinstance(a, str) for a in answers):
            raise _PolicyFailure(f"extract returned {answers!r}; answers must be str")
        if len(candidates) == 1:
            chosen = candidates[0]
        else:
            index = self._call(policy.select.choose, [b.view() for b in candidates], answers)
            matches = [b for b in candidates if b.index == index]
            if not matches:
                raise _PolicyFailure(f"selector chose {index!r}, not a completed branch")
            chosen = matches[0]
        answer_of = {b.index: a for b, a in zip(candidates, answers)}
        stopped = []
        for branch in req.branches:
            if branch.status is BranchStatus.RUNNING:
                self._end_running(branch, req, BranchStatus.STOPPED)
                stopped.append(branch.id)
            elif branch.status is BranchStatus.WAITING:
                branch.status = BranchStatus.STOPPED  # never started: nothing to free
        if stopped:
            self._outbox.append(Abort(tuple(stopped)))
        result = RequestResult(
            request_id=req.id,
            status=RequestStatus.COMPLETED,
            chosen=chosen.index,
            text=chosen.text,
            answer=answer_of[chosen.index],
            branches=tuple(b.outcome(answer_of.get(b.index)) for b in req.branches),
            timings=req.timings(now),
            policy=policy.name,
            prm_items=req.prm_items,
        )
        self._close(req, result, now)

    def _fail(self, req: RequestState, reason: str, now: float) -> None:
        if req.ended:
            return
        aborted = []
        for branch in req.branches:
            if branch.status is BranchStatus.RUNNING:
                self._end_running(branch, req, BranchStatus.FAILED)
                aborted.append(branch.id)
            elif not branch.status.is_ended:
                branch.status = BranchStatus.FAILED
        if aborted:
            self._outbox.append(Abort(tuple(aborted)))
        result = RequestResult(
            request_id=req.id,
            status=RequestStatus.FAILED,
            chosen=None,
            text=None,
            answer=None,
            branches=tuple(b.outcome(None) for b in req.branches),
            timings=req.timings(now),
            reason=reason,
            policy=req.policy.name,
            prm_items=req.prm_items,
        )
        self._close(req, result, now)

    def _end_running(self, branch: BranchState, req: RequestState, status: BranchStatus) -> None:
        branch.status = status
        branch.end_step = self._step
        branch.ended_in = req.phase
        del self._running[branch.id]
        req.running -= 1

    def _close(self, req: RequestState, result: RequestResult, now: float) -> None:
        req.ended = True
        req.finished_at = now
        req.newly_ended = []
        if req.prefilled:
            self._outbox.append(ReleasePrefix(req.id))
        self._outbox.append(Finish(result))
        del self._pending[req.id]
        self._active.pop(req.id, None)
        self._finished += 1

    @staticmethod
    def _limits(value: object, hook: str) -> Limits:
        """A hook's ``Limits``, checked, so a bad value fails its request, not the run."""
        ok = (
            isinstance(value, Limits)
            and isinstance(value.max_num_pruned, int)
            and value.max_num_pruned >= 0
            and (value.threshold is None or isinstance(value.threshold, (int, float)))
        )
        if not ok:
            raise _PolicyFailure(f"prune rule's {hook} returned {value!r}, not valid Limits")
        return value  # type: ignore[return-value]

    @staticmethod
    def _call(fn: Callable[..., T], *args: object, name: str | None = None) -> T:
        """Run a policy hook; anything it raises fails only its request."""
        try:
            return fn(*args)
        except Exception as exc:
            name = name or getattr(fn, "__qualname__", repr(fn))
            raise _PolicyFailure(f"policy hook {name} raised {exc!r}") from exc
