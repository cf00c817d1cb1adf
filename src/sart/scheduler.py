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

Scoring. With ``Scoring.BLOCKING`` (Algorithm 1 as written) a ``Score`` is
answered before anything else runs. With ``Scoring.OVERLAPPED`` the
scheduler keeps emitting admissions and decodes while one ``Score`` is in
flight: a request whose check needs rewards takes a *snapshot* (the branches
that ended since its last check, and whether pruning is due), sends the
snapshot's items, and its check runs when the rewards arrive, against the
branches' state at that moment: a branch that ended or was pruned meanwhile
is not pruned again, a request that finished meanwhile ignores them, and
branches that ended after the snapshot wait for the next check. A request
never finalises while one of its completed branches still waits for its
final reward, so selection sees the same rewards in both modes. At most
``max_scores`` (``K``: the PRM's workers) ``Score`` commands are in flight,
each with its own snapshot, and one request has at most one check in flight;
checks that come due while ``K`` are in flight wait for one to come back, and
decode chunks are cut to ``poll_steps`` so rewards are applied soon after they
arrive. Checks that need no rewards (Self-Consistency, Vanilla) run at once in
both modes. Blocking scoring keeps one ``Score`` at a time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
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
    Pause,
    Prefill,
    Prefilled,
    ReleasePrefix,
    Score,
    Scored,
    Skipped,
    StartBranches,
    Started,
)
from sart.errors import ConfigError, PRMError, SchedulerError, enum_converter, int_at_least
from sart.messages import BranchSpec, ScoreItem, validate_reward
from sart.request import Request
from sart.results import RequestResult
from sart.state import BranchState, RequestMeta, RequestState
from sart.types import (
    Admission,
    BranchId,
    BranchStatus,
    FinishReason,
    Phase,
    RequestStatus,
    Scoring,
)
from sart.views import Limits, RequestView

T = TypeVar("T")


def _positive_or_none(_inst: object, attr: attrs.Attribute, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"{attr.name}={value!r} must be None or > 0")


def _to_admission(value: object) -> Admission:
    return enum_converter(Admission, "admission")(value)


def _to_scoring(value: object) -> Scoring:
    return enum_converter(Scoring, "scoring")(value)


@attrs.frozen
class SchedulerConfig:
    """Settings of the scheduler (per-request settings live in each request's ``Policy``)."""

    batch_size: int = attrs.field(validator=int_at_least(1))
    """``B``: the most branches decoding at once."""
    admission: Admission = attrs.field(default=Admission.CHUNK, converter=_to_admission)
    """When freed slots are refilled: between chunks (Algorithm 1) or at the next step."""
    scoring: Scoring = attrs.field(default=Scoring.OVERLAPPED, converter=_to_scoring)
    """Whether decoding waits for PRM checks (Algorithm 1 as written) or goes on meanwhile."""
    poll_steps: int | None = attrs.field(default=None, validator=int_at_least(1, optional=True))
    """With overlapped scoring, the longest decode chunk while a ``Score`` is in flight;
    ``None``: an eighth of the shortest interval among running requests."""
    max_scores: int = attrs.field(default=1, validator=int_at_least(1))
    """With overlapped scoring, the most ``Score`` commands in flight at once (``K``:
    as many as the PRM has workers -- processes, servers, replicas -- to score them
    side by side). Blocking scoring (Algorithm 1) scores one check batch at a time:
    it takes only 1."""
    aging: float | None = attrs.field(default=None, validator=_positive_or_none)
    """With several priorities: every waiting request gains one level of urgency per
    ``aging`` time units it has waited since its arrival, so that none waits for
    ever behind a stream of more urgent ones: a request ``d`` levels less urgent
    than others goes before every one of them that arrived more than
    ``d * aging`` after it (so it waits only for those that came before that).
    ``None``: strict priorities (a steady stream of urgent requests can starve the
    others)."""
    pause: bool = False
    """With several priorities: when more urgent work waits and the budget is full,
    pause running branches of less urgent requests (``Pause``: the engine frees their
    KV and keeps their tokens) and resume them later, from those tokens, when they
    are the most urgent waiting work. Never more branches than the more urgent
    waiting work can take, never a request's last running branch; which ones, its
    policy's ``PauseRule`` says. Needs an engine that can (``supports_pause``): the
    drivers turn it on for one."""

    def __attrs_post_init__(self) -> None:
        if self.scoring is Scoring.BLOCKING and self.max_scores != 1:
            raise ConfigError(
                f"max_scores={self.max_scores} must be 1 with scoring='blocking' (Algorithm 1 "
                "waits for each check before anything else runs)"
            )


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
    paused_branches: int = 0
    """Branches paused for more urgent work (``SchedulerConfig.pause``), over the run."""


class _PolicyFailure(Exception):
    """A policy hook raised or returned something unusable; fails one request."""


@attrs.define
class _Check:
    """One request's check: the branches that ended since its last check (this
    check processes them), and whether pruning was due when it was taken."""

    req: RequestState
    ended: list[BranchState]
    due: bool


class Scheduler:
    """Algorithm 1 over many requests. See the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._request_queue: deque[RequestState] = deque()
        self._branch_queue: deque[BranchState] = deque()
        self._priorities: set[int] = set()  # of the requests submitted
        self._pending: dict[str, RequestState] = {}  # submitted, not finished
        self._active: dict[str, RequestState] = {}  # prefilled (or prefilling), not finished
        self._running: dict[BranchId, BranchState] = {}
        self._reserved: set[BranchId] = set()  # start commands in flight
        self._step = 0
        self._outbox: list[Command] = []
        self._ids = itertools.count(1)
        self._inflight: dict[int, Command] = {}  # emitted, not answered, by id
        # The checks waiting for the rewards of each Score in flight (by its id), and of
        # those still in the outbox (in the order they were queued: they get ids so).
        self._scores: dict[int, list[_Check]] = {}
        self._queued_scores: deque[list[_Check]] = deque()
        # Overlapped scoring: requests whose check needs rewards, waiting for the PRM.
        self._wanted: dict[str, RequestState] = {}
        self._finished = 0
        self._failed_cleanups = 0
        # Branches the scheduler ended whose Abort the engine failed to carry out: the
        # engine may still decode them, so they hold a batch slot until it lets go.
        self._unaborted: set[BranchId] = set()
        self._unreleased: set[str] = set()  # prefixes not released because of those
        self._idle_abort_retries = 0
        self._pauses = 0  # branches paused for more urgent work, over the run
        self._cancels: dict[str, str] = {}  # asked for, applied at the next next_commands
        # (deadline, order, request) of requests with a timeout; ended ones dropped lazily.
        self._deadlines: list[tuple[float, int, RequestState]] = []
        self._deadline_order = itertools.count()

    # ------------------------------------------------------------------ intake

    def submit(self, request: Request) -> None:
        """Queue a request that has arrived (FCFS in submission order)."""
        if request.id in self._pending:
            raise ConfigError(f"id={request.id!r} must be unique among requests in flight")
        state = RequestState(request)
        self._pending[request.id] = state
        self._request_queue.append(state)
        self._priorities.add(request.priority)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._deadline_order), state))

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Cancel a request that has not finished: it ends with
        ``RequestStatus.CANCELLED`` and ``reason``, its running branches are aborted
        and its prefix released, like a failed request's, and its waiting branches
        never start. ``False`` if no such request is open (unknown, or finished).

        It takes effect at the next ``next_commands``, when no command of it is in
        flight but an overlapped ``Score`` (whose rewards for it are then ignored),
        so it may be called at any time between the scheduler's calls. Events
        handled before then may still finish the request (``True`` said it was
        open, not that it will end cancelled), as a vLLM request may finish before
        its abort lands."""
        if request_id not in self._pending:
            return False
        self._cancels.setdefault(request_id, reason)
        return True

    def next_deadline(self) -> float | None:
        """The earliest deadline (``Request.deadline``) of a request not finished yet: a
        driver with nothing else to do wakes then to cancel it."""
        while self._deadlines and self._deadlines[0][2].ended:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _expire(self, now: float) -> None:
        """Cancel the requests whose deadline has come."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if not req.ended:
                reason = f"timed out: not finished within timeout={req.request.timeout:g}"
                self._cancels.setdefault(req.id, reason)

    def _apply_cancels(self, now: float) -> None:
        cancels, self._cancels = self._cancels, {}
        for request_id, reason in cancels.items():
            req = self._pending.get(request_id)
            if req is None or req.ended:
                continue
            if req.id not in self._active:  # still queued: never prefilled
                self._request_queue.remove(req)
            self._end_unfinished(
                req, RequestStatus.CANCELLED, reason, max(now, req.request.arrival)
            )

    @property
    def idle(self) -> bool:
        """Nothing queued, running or left to emit."""
        return not self._pending and not self._outbox and not self._inflight

    @property
    def scoring_in_flight(self) -> bool:
        """A ``Score`` has been emitted and not answered yet."""
        return bool(self._scores)

    @property
    def scores_in_flight(self) -> int:
        """``Score`` commands emitted and not answered yet (at most ``max_scores``)."""
        return len(self._scores)

    def running_request_ids(self) -> list[str]:
        """Requests with branches decoding now (the ones a stalled decode delays)."""
        return [req.id for req in self._active.values() if req.running]

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
            paused_branches=self._pauses,
        )

    # ---------------------------------------------------------------- decide

    def next_commands(self, now: float) -> list[Command]:
        """Commands to carry out now; empty when there is nothing to do until a request
        arrives or, with a ``Score`` in flight, until its rewards are handled.

        Every command but an overlapped ``Score`` must be answered before the next
        call (``SchedulerError`` otherwise)."""
        if any(not isinstance(c, Score) for c in self._inflight.values()):
            raise SchedulerError("handle() the events of the previous commands first")
        if self._scores and self.config.scoring is Scoring.BLOCKING:
            return []  # Algorithm 1: nothing runs while the PRM scores
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire(now)
        if self._cancels:
            self._apply_cancels(now)
        if self._outbox:
            cmds, self._outbox = self._outbox, []
        else:
            cmds = self._admit(now)
            if not cmds and self._running:
                cmds = [self._decode_command()]
            if not cmds and not self._scores:
                cmds = self._retry_aborts()
        cmds = [attrs.evolve(cmd, id=next(self._ids)) for cmd in cmds]
        for cmd in cmds:
            self._inflight[cmd.id] = cmd
            if isinstance(cmd, Score):
                self._scores[cmd.id] = self._queued_scores.popleft()
        return cmds

    #: Aborts retried when nothing else runs, before the scheduler gives up on them.
    IDLE_ABORT_RETRIES = 3

    def _retry_aborts(self) -> list[Command]:
        """Nothing else to do: ask again for aborts the engine failed, then for the
        prefixes they held up (a branch would otherwise stay live in the engine after
        the run), a bounded number of times."""
        if not (self._unaborted or self._unreleased):
            self._idle_abort_retries = 0
            return []
        if self._idle_abort_retries >= self.IDLE_ABORT_RETRIES:
            # The engine keeps refusing: given up, counted in failed_cleanups.
            self._unaborted.clear()
            self._unreleased.clear()
            return []
        self._idle_abort_retries += 1
        cmds: list[Command] = []
        if self._unaborted:
            cmds.append(Abort(tuple(sorted(self._unaborted))))
        cmds.extend(ReleasePrefix(rid) for rid in sorted(self._unreleased))
        return cmds

    def _admit(self, now: float) -> list[Command]:
        free = self._free()
        if len(self._priorities) > 1 and (free > 0 or self.config.pause):
            return self._admit_by_priority(now, max(free, 0))
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
            cmds.extend(self._admit_request(self._request_queue.popleft(), now, free))
            free = self._free()
        return cmds

    def _free(self) -> int:
        return (
            self.config.batch_size - len(self._running) - len(self._reserved) - len(self._unaborted)
        )

    def _urgency(self, request: Request, now: float) -> int:
        """A request's effective priority now (lower first): its own, less one level
        per ``aging`` it has waited."""
        if self.config.aging is None:
            return request.priority
        return request.priority - math.floor(max(0.0, now - request.arrival) / self.config.aging)

    def _admit_by_priority(self, now: float, free: int) -> list[Command]:
        """``_admit`` with several priorities: each free slot goes to the most urgent of
        the waiting branches (of admitted requests) and the waiting requests; in a
        tie, a waiting branch first (as Algorithm 1), then the earlier in its queue.
        With ``pause``, less urgent running branches then make room for more urgent
        work still waiting (``_pause_for_urgent``)."""
        cmds = self._fill_by_priority(now, free)
        if self.config.pause and (self._branch_queue or self._request_queue):
            paused = self._pause_for_urgent(now)
            if paused:
                cmds.append(Pause(tuple(b.id for b in paused)))
                cmds.extend(self._fill_by_priority(now, self._free()))
        return cmds

    def _fill_by_priority(self, now: float, free: int) -> list[Command]:
        """Give ``free`` slots to the most urgent waiting work (see ``_admit_by_priority``)."""

        def branch_urgency(branch: BranchState) -> int:
            return self._urgency(self._pending[branch.id.request_id].request, now)

        def request_urgency(req: RequestState) -> int:
            return self._urgency(req.request, now)

        waiting = BranchStatus.WAITING
        self._branch_queue = deque(b for b in self._branch_queue if b.status is waiting)
        starts: dict[str, list[BranchState]] = {}
        cmds: list[Command] = []
        while free > 0 and (self._branch_queue or self._request_queue):
            branch_at, branch_key = _first_min(self._branch_queue, branch_urgency)
            request_at, request_key = _first_min(self._request_queue, request_urgency)
            if branch_at is not None and (request_at is None or branch_key <= request_key):
                branch = self._branch_queue[branch_at]
                del self._branch_queue[branch_at]
                starts.setdefault(branch.id.request_id, []).append(branch)
                free -= 1
                continue
            assert request_at is not None
            req = self._request_queue[request_at]
            del self._request_queue[request_at]
            # Branches picked so far start first: the engine sees them in this order.
            cmds.extend(self._start(rid, branches) for rid, branches in starts.items())
            starts = {}
            cmds.extend(self._admit_request(req, now, free))
            free = self._free()
        cmds.extend(self._start(rid, branches) for rid, branches in starts.items())
        return cmds

    def _pause_for_urgent(self, now: float) -> list[BranchState]:
        """Pause running branches of less urgent requests for more urgent waiting work, and
        queue them to resume; return them (empty: nothing to pause).

        The waiting work, most urgent first (a waiting branch needs one slot, a waiting
        request ``n``), takes branches from running requests strictly less urgent than
        it, the least urgent first (then the latest to arrive), each keeping one branch
        running; so no more are paused than that work can use, and a request is never
        paused for one as urgent as itself (no two requests take turns)."""

        def urgency(req: RequestState) -> int:
            return self._urgency(req.request, now)

        waiting: list[tuple[int, int]] = [  # (urgency, slots wanted)
            (urgency(self._pending[b.id.request_id]), 1)
            for b in self._branch_queue
            if b.status is BranchStatus.WAITING
        ]
        waiting += [(urgency(req), req.n) for req in self._request_queue]
        if not waiting:
            return []
        waiting.sort(key=lambda w: w[0])
        donors = sorted(
            (req for req in self._active.values() if req.running > 1 and not req.ended),
            key=lambda req: (-urgency(req), -req.request.arrival),
        )
        spare = {req.id: req.running - 1 for req in donors}
        taken: dict[str, int] = {}
        for level, wanted in waiting:
            for req in donors:
                if wanted == 0 or urgency(req) <= level:
                    break  # donors are sorted: the rest are as urgent or more
                give = min(wanted, spare[req.id])
                spare[req.id] -= give
                taken[req.id] = taken.get(req.id, 0) + give
                wanted -= give
        paused: list[BranchState] = []
        for rid, count in taken.items():
            req = self._active[rid]
            if count:
                try:
                    paused.extend(self._choose_paused(req, count))
                except _PolicyFailure as exc:  # its own rule is broken: as a prune rule's
                    self._fail(req, str(exc), now)
        for branch in paused:
            req = self._active[branch.id.request_id]
            del self._running[branch.id]
            req.running -= 1
            branch.status = BranchStatus.WAITING
            branch.paused = True
            self._branch_queue.append(branch)
            self._pauses += 1
        return paused

    def _choose_paused(self, req: RequestState, count: int) -> list[BranchState]:
        """The first ``count`` running branches of ``req`` in its ``PauseRule``'s order."""
        rule = req.policy.pause
        chosen = self._call(
            lambda v: list(rule.choose(v)), req.view(), name=f"{type(rule).__name__}.choose"
        )
        return _running_choices(req, chosen, "pause")[:count]

    def _admit_request(self, req: RequestState, now: float, free: int) -> list[Command]:
        """Admit ``req``: its prune rule's limits, its prefill and as many of its branches
        as ``free`` slots allow (the rest wait in the branch queue after the prefill)."""
        req.scheduled_at = now
        try:  # before the engine holds anything for it, so failing costs nothing
            req.limits = self._limits(self._call(req.policy.prune.start, req.n), "start")
        except _PolicyFailure as exc:
            self._fail(req, str(exc), now)
            return []
        self._active[req.id] = req
        take = req.branches[: min(req.n, free)]
        return [Prefill(req.request), self._start(req.id, take)]

    def _start(self, request_id: str, branches: Sequence[BranchState]) -> StartBranches:
        self._reserved.update(b.id for b in branches)
        specs = tuple(BranchSpec(index=b.index, seed=b.seed, resume=b.paused) for b in branches)
        for branch in branches:
            branch.paused = False
        return StartBranches(request_id=request_id, branches=specs)

    def _decode_command(self) -> Decode:
        # Decode until the next request's check is due; with one policy that is T steps.
        running = [req for req in self._active.values() if req.running]
        if not self._scores:
            steps = min(req.policy.interval - req.steps_since_check for req in running)
        else:
            # A check that waits for the PRM cannot run sooner by decoding less; the
            # others bound the chunk, and so does the Score in flight, so that its
            # rewards are applied within ``poll`` steps of arriving.
            poll = self.config.poll_steps or max(1, min(r.policy.interval for r in running) // 8)
            waiting = [
                req.policy.interval - req.steps_since_check
                for req in running
                if req.id not in self._wanted and not req.in_score
            ]
            steps = min([poll, *waiting])
        return Decode(
            max_steps=max(1, steps), until_first_end=self.config.admission is Admission.TOKEN
        )

    # ----------------------------------------------------------------- apply

    def handle(self, events: Sequence[Event] | Mapping[int, Event], now: float) -> None:
        """Apply events answering commands in flight.

        A mapping answers the commands with those ids (any subset, any order; they
        are applied in id order). A sequence answers every command in flight, in
        id order: the blocking protocol, one event per command of the last batch.
        """
        if not self._inflight:
            raise SchedulerError("handle() called with no commands in flight")
        if isinstance(events, Mapping):
            unknown = sorted(set(events) - self._inflight.keys())
            if unknown:
                raise SchedulerError(f"events answer command ids {unknown} not in flight")
            answers = sorted(events.items())
        else:
            if len(events) != len(self._inflight):
                raise SchedulerError(
                    f"{len(self._inflight)} commands were answered by {len(events)} events"
                )
            answers = list(zip(sorted(self._inflight), events))
        for cmd_id, event in answers:
            cmd = self._inflight.pop(cmd_id)
            if isinstance(cmd, Prefill):
                self._on_prefill(cmd, event, now)
            elif isinstance(cmd, StartBranches):
                self._on_start(cmd, event, now)
            elif isinstance(cmd, Decode):
                self._on_decode(event, now)
            elif isinstance(cmd, Score):
                self._on_score(cmd, event, now)
            elif isinstance(cmd, Pause):
                self._on_pause(cmd, event, now)
            elif isinstance(event, Failed):  # Abort, ReleasePrefix, Finish
                self._failed_cleanups += 1
                if isinstance(cmd, Abort):  # asked again when the engine next reports them
                    self._unaborted.update(cmd.branches)
            elif isinstance(event, Done):
                if isinstance(cmd, Abort):
                    self._unaborted.difference_update(cmd.branches)
                elif isinstance(cmd, ReleasePrefix):
                    self._unreleased.discard(cmd.request_id)
            elif isinstance(event, Skipped) and isinstance(cmd, ReleasePrefix):
                self._unreleased.add(cmd.request_id)  # after its branches' abort, retried
            else:
                raise SchedulerError(f"{type(cmd).__name__} answered by {event!r}")

    def _on_pause(self, cmd: Pause, event: Event, now: float) -> None:
        if isinstance(event, Done):
            return
        if not isinstance(event, (Failed, Skipped)):
            raise SchedulerError(f"Pause answered by {event!r}")
        # Not paused: the engine still runs them (an engine's pause changes nothing when
        # it fails), and the slots they were to free went to this batch's starts, so the
        # engine holds up to that many branches over the budget until the abort sent now
        # frees them. They hold their slots until it does; every request of the command
        # fails (its branches would otherwise wait for ever for a resume).
        self._failed_cleanups += isinstance(event, Failed)
        self._unaborted.update(cmd.branches)
        self._outbox.append(Abort(cmd.branches))
        why = event.reason if isinstance(event, Failed) else "skipped after an earlier failure"
        for rid in sorted(cmd.request_ids):
            req = self._pending.get(rid)
            if req is not None:
                self._fail(req, f"pausing branches failed: {why}", now)

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
        retry: list[BranchId] = []
        for bid, delta in out.deltas.items():
            branch = self._running.get(bid)
            if branch is None and bid in self._unaborted:
                # Ended here, still live there: its tokens are dropped, its abort retried.
                if delta.finish is None:
                    retry.append(bid)
                else:
                    self._unaborted.discard(bid)
                continue
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
        if retry:
            self._outbox.append(Abort(tuple(retry)))
        if not self._running and self.config.admission is Admission.CHUNK:
            # Every branch ended before T steps: Algorithm 1 checks every request
            # after each Decode call, and the next Decode runs a full T steps.
            for req in self._active.values():
                req.steps_since_check = 0
        wanting = [req for req in self._active.values() if req.newly_ended or self._is_due(req)]
        if self.config.scoring is Scoring.BLOCKING:
            checks = [self._take(self._next_check(req)) for req in wanting]
            items = [item for check in checks for item in self._score_items(check)]
            if items:  # every check waits for the rewards, as in Algorithm 1
                self._send_score(checks, items)
            else:
                self._run_checks(checks, now)
        else:
            self._wanted.update((req.id, req) for req in wanting if not req.in_score)
            self._flush_checks(now)

    def _next_check(self, req: RequestState) -> _Check:
        """What ``req``'s check would process if it were taken now."""
        return _Check(req, req.newly_ended, self._is_due(req))

    @staticmethod
    def _take(check: _Check) -> _Check:
        """Start ``check``: the branches it processes and its due interval are its own now."""
        if check.due:
            check.req.steps_since_check = 0
        check.req.newly_ended = []
        return check

    def _flush_checks(self, now: float) -> None:
        """Overlapped scoring: run the wanted checks that need no rewards now; send the
        others' snapshot to the PRM, in one ``Score``, unless ``max_scores`` are in
        flight already."""
        busy = len(self._scores) + len(self._queued_scores) >= self.config.max_scores
        sent: list[_Check] = []
        items: list[ScoreItem] = []
        ready: list[_Check] = []
        for rid, req in list(self._wanted.items()):
            if req.ended:
                del self._wanted[rid]
                continue
            check = self._next_check(req)
            wants = self._score_items(check)
            if wants and busy:
                continue  # its snapshot is taken when the PRM is free: fresher rewards
            del self._wanted[rid]
            (sent if wants else ready).append(self._take(check))
            items.extend(wants)
        if sent:
            self._send_score(sent, items)
        self._run_checks(ready, now)

    @staticmethod
    def _is_due(req: RequestState) -> bool:
        return req.steps_since_check >= req.policy.interval

    def _send_score(self, checks: list[_Check], items: list[ScoreItem]) -> None:
        for check in checks:
            check.req.in_score = True
        for item in items:
            self._pending[item.branch.request_id].prm_items += 1
        self._queued_scores.append(checks)
        self._outbox.append(Score(tuple(items)))

    def _score_items(self, check: _Check) -> list[ScoreItem]:
        req, policy = check.req, check.req.policy
        branches: list[BranchState] = []
        if policy.scores_completed:
            branches.extend(b for b in check.ended if b.status.is_completed)
        if check.due and policy.scores_running and self._may_prune(req, check.ended):
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

    @staticmethod
    def _may_prune(req: RequestState, ended: Sequence[BranchState]) -> bool:
        """Whether a check could prune: the budget is not spent, or the phase is
        about to change (a first completion), which may raise it."""
        if req.phase is Phase.EXPLORE and any(b.status.is_completed for b in ended):
            return True
        return min(req.limits.max_num_pruned, len(req.branches) - 1) > req.num_pruned

    def _on_score(self, cmd: Score, event: Event, now: float) -> None:
        if not isinstance(event, Scored):
            raise SchedulerError(f"Score answered by {event!r}")
        checks = self._scores.pop(cmd.id)
        for check in checks:
            check.req.in_score = False
        for request_id, reason in event.failures.items():
            req = self._pending.get(request_id)
            if req is not None:
                self._fail(req, f"PRM failed: {reason}", now)
        tokens = {item.branch: item.num_tokens for item in cmd.items}
        for bid, value in event.rewards.items():
            req = self._pending.get(bid.request_id)
            if req is None or req.ended:
                continue  # finished (or failed) while it was scored
            try:
                branch = req.branches[bid.index]
                branch.reward = validate_reward(value, bid)
                # The reward of the snapshot: overlapped, the branch may have grown since.
                branch.reward_history.append((tokens.get(bid, branch.num_tokens), branch.reward))
            except PRMError as exc:
                self._fail(req, str(exc), now)
        self._run_checks(checks, now)
        if self.config.scoring is Scoring.OVERLAPPED:
            # Branches that ended meanwhile, and checks that came due, go next.
            self._wanted.update(
                (c.req.id, c.req)
                for c in checks
                if not c.req.ended and (c.req.newly_ended or self._is_due(c.req))
            )
            self._flush_checks(now)

    # ----------------------------------------------------------------- check

    def _run_checks(self, checks: Sequence[_Check], now: float) -> None:
        for check in checks:
            if check.req.ended:
                continue
            try:
                self._check(check, now)
            except _PolicyFailure as exc:
                self._fail(check.req, str(exc), now)

    def _check(self, check: _Check, now: float) -> None:
        req = check.req
        completed = [b for b in check.ended if b.status.is_completed]
        prune = req.policy.prune
        if completed and req.phase is Phase.EXPLORE:
            req.phase = Phase.EXPLOIT
            first = min(completed, key=lambda b: (b.end_step, b.index))
            req.limits = self._limits(
                self._call(prune.enter_exploit, req.limits, first.view(), req.n), "enter_exploit"
            )
        req.num_completed += len(completed)
        view = None
        if check.due and prune.active and req.running and self._may_prune(req, check.ended):
            view = self._prune(req)
        if any(b.status.is_completed for b in req.newly_ended):
            # Overlapped: a branch completed after this check's snapshot; its final
            # reward comes with the next check, and selection waits for it.
            return
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
        victims = _running_choices(req, chosen, "prune")
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
        self._end_unfinished(req, RequestStatus.FAILED, reason, now)

    def _end_unfinished(
        self, req: RequestState, status: RequestStatus, reason: str, now: float
    ) -> None:
        """End ``req`` without an answer (failed or cancelled): abort its running
        branches; the waiting ones never start."""
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
            status=status,
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


def _running_choices(req: RequestState, chosen: Sequence[object], rule: str) -> list[BranchState]:
    """The branches a rule named, checked: each an index of a running branch, once
    (``_PolicyFailure`` naming the ``rule`` otherwise)."""
    picked: list[BranchState] = []
    for index in chosen:
        if not isinstance(index, int) or not 0 <= index < len(req.branches):
            raise _PolicyFailure(f"{rule} rule chose {index!r}, not a branch index")
        branch = req.branches[index]
        if branch.status is not BranchStatus.RUNNING or branch in picked:
            raise _PolicyFailure(f"{rule} rule chose branch {index}, which is not running")
        picked.append(branch)
    return picked


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
