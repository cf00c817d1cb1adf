"""``Scheduler``: Algorithm 1 over many requests, as a sans-IO state machine.

It owns the requests (``RequestState``) and wires the package's parts together:
admission from the ``WaitQueue``, the batch budget in ``Slots``, checks through
the ``CheckQueue``, each request's check by the rules in ``algorithm``, cancels
and deadlines in ``Cancellations``. ``next_commands`` decides; ``handle``
applies the engine's answers. It performs no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from sart.commands import (
    Abort,
    Command,
    Decode,
    Decoded,
    Done,
    Event,
    Failed,
    Pause,
    Prefill,
    Prefilled,
    Score,
    Scored,
    Skipped,
    StartBranches,
    Started,
)
from sart.errors import ConfigError, PRMError, SchedulerError
from sart.messages import validate_reward
from sart.request import Request
from sart.scheduler.cancels import Cancellations
from sart.scheduler.checks import CheckQueue, is_due
from sart.scheduler.config import SchedulerConfig, SchedulerStats
from sart.scheduler.hooks import (
    PolicyFailure,
    admitted_policy,
    call,
    checked_limits,
    choose_running,
)
from sart.scheduler.load_meter import LoadMeter
from sart.scheduler.requests import RequestTable
from sart.scheduler.slots import Slots
from sart.scheduler.waiting import WaitQueue
from sart.state import BranchState, RequestMeta, RequestState
from sart.types import Admission, BranchId, BranchStatus, FinishReason, RequestStatus
from sart.views import Load


class Scheduler:
    """Algorithm 1 over many requests. See the package docstring."""

    #: Aborts retried when nothing else runs, before the scheduler gives up on them.
    IDLE_ABORT_RETRIES = Slots.IDLE_ABORT_RETRIES

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._waiting = WaitQueue(config.aging)
        self._slots = Slots(config.batch_size)
        self._checks = CheckQueue(config)
        self._cancels = Cancellations()
        self._requests = RequestTable(self._slots, self._waiting)
        # The table's, under short names: the open requests, and the commands to emit.
        self._pending = self._requests.pending
        self._active = self._requests.active
        self._outbox = self._requests.outbox
        self._next_id = 1
        self._inflight: dict[int, Command] = {}  # emitted, not answered, by id
        self._pauses = 0  # branches paused for more urgent work, over the run
        self._meter = LoadMeter()
        self._requests.load_of = self.load

    # ------------------------------------------------------------------ intake

    def submit(self, request: Request) -> None:
        """Queue a request that has arrived (FCFS in submission order)."""
        if request.id in self._pending:
            raise ConfigError(f"id={request.id!r} must be unique among requests in flight")
        state = RequestState(request)
        self._pending[request.id] = state
        self._waiting.add_request(state)
        self._cancels.watch(state)
        self._meter.arrived(request.arrival)

    def observe(self, kv_tokens: int | None, kv_capacity: int | None = None) -> None:
        """The engine's KV-cache use, as it last reported it (``EngineStats``): what
        ``Load`` shows policies. Drivers call it as they sample the engine."""
        self._meter.observe(kv_tokens, kv_capacity)

    def load(self, req: RequestState, now: float) -> Load:
        """The server's load as ``req``'s policy sees it now."""
        return self._meter.view(
            waiting_requests=self._waiting.queued_requests,
            waiting_branches=self._waiting.queued_branches,
            running_branches=len(self._slots.running),
            budget=self.config.batch_size,
            active_requests=len(self._active),
            waited=max(0.0, now - req.request.arrival),
            prm_waiting=self._checks.waiting,
        )

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
        self._cancels.ask(request_id, reason)
        return True

    def next_deadline(self) -> float | None:
        """The earliest deadline (``Request.deadline``) of a request not finished yet: a
        driver with nothing else to do wakes then to cancel it."""
        return self._cancels.next_deadline()

    # ------------------------------------------------------------------ state

    @property
    def idle(self) -> bool:
        """Nothing queued, running or left to emit."""
        return not self._pending and not self._outbox and not self._inflight

    @property
    def scoring_in_flight(self) -> bool:
        """A ``Score`` has been emitted and not answered yet."""
        return bool(self._checks.in_flight)

    @property
    def scores_in_flight(self) -> int:
        """``Score`` commands emitted and not answered yet (at most ``max_scores``)."""
        return len(self._checks.in_flight)

    def running_request_ids(self) -> list[str]:
        """Requests with branches decoding now (the ones a stalled decode delays)."""
        return [req.id for req in self._running_requests()]

    def meta(self, request_id: str) -> RequestMeta:
        """The paper's metadata record of a request that has not finished (``KeyError``
        naming it for one that has, or was never submitted)."""
        req = self._pending.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not open: finished, or never submitted")
        return req.meta()

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            step=self._requests.step,
            queued_requests=self._waiting.queued_requests,
            queued_branches=self._waiting.queued_branches,
            running_branches=len(self._slots.running),
            active_requests=len(self._active),
            finished_requests=self._requests.finished,
            failed_cleanups=self._slots.failed_cleanups,
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
        if self._checks.blocking and self._checks.in_flight:
            return []  # Algorithm 1: nothing runs while the PRM scores
        for request_id, reason in self._cancels.take(now).items():
            req = self._pending.get(request_id)
            if req is not None and not req.ended:
                self._requests.end_unfinished(
                    req, RequestStatus.CANCELLED, reason, max(now, req.request.arrival)
                )
        if self._outbox:
            cmds = list(self._outbox)
            self._outbox.clear()
        else:
            cmds = self._admit(now)
            if self._outbox:
                # A request failed while admitting (its own admit, start or pause hook):
                # its aborts go before the starts that may take their slots, and no
                # Decode goes with them (the engine still runs the aborted branches).
                cmds = [*self._outbox, *cmds]
                self._outbox.clear()
            elif not cmds and self._slots.running:
                cmds = [self._decode_command()]
            if not cmds and not self._checks.in_flight:
                cmds = self._slots.retry_aborts()
        emitted = []
        for cmd in cmds:
            cmd = attrs.evolve(cmd, id=self._next_id)
            self._next_id += 1
            self._inflight[cmd.id] = cmd
            if isinstance(cmd, Score):
                self._checks.sent(cmd.id)
            elif isinstance(cmd, Decode):
                self._meter.steps.started(now, len(self._slots.running))
            emitted.append(cmd)
        return emitted

    def _admit(self, now: float) -> list[Command]:
        """Fill free slots with the most urgent waiting work; with ``pause`` and several
        priorities, then pause less urgent running branches for more urgent work that
        still waits, and fill the slots they free."""
        cmds = self._fill(now, self._slots.free())
        if self.config.pause and self._waiting.several_levels and self._waiting:
            paused = self._pause_for_urgent(now)
            if paused:
                cmds.append(Pause(tuple(b.id for b in paused)))
                cmds.extend(self._fill(now, self._slots.free()))
        return cmds

    def _fill(self, now: float, free: int) -> list[Command]:
        """Give ``free`` slots to waiting work: a waiting branch takes one; a request is
        prefilled and as many of its branches start as slots allow (Algorithm 1,
        lines 11-19). Branches of one request start in one command, in queue order."""
        starts: dict[str, list[BranchState]] = {}
        cmds: list[Command] = []
        while free > 0:
            item = self._waiting.pop(now)
            if item is None:
                break
            if isinstance(item, tuple):
                req, branch = item
                starts.setdefault(req.id, []).append(branch)
                free -= 1
                continue
            # Branches picked so far start first: the engine sees them in this order.
            cmds.extend(self._slots.start(rid, branches) for rid, branches in starts.items())
            starts = {}
            cmds.extend(self._admit_request(item, now, free))
            free = self._slots.free()
        cmds.extend(self._slots.start(rid, branches) for rid, branches in starts.items())
        return cmds

    def _admit_request(self, req: RequestState, now: float, free: int) -> list[Command]:
        """Admit ``req``: its prune rule's limits, its prefill and as many of its branches
        as ``free`` slots allow (the rest wait in the branch queue after the prefill)."""
        req.scheduled_at = now
        try:  # before the engine holds anything for it, so failing costs nothing
            if req.policy.admit.active:
                req.load = self.load(req, now)
                req.policy = admitted_policy(req.policy, req.load)
                del req.branches[req.policy.n :]  # none has started or been queued
            req.limits = checked_limits(call(req.policy.prune.start, req.n), "start")
        except PolicyFailure as exc:
            self._requests.fail(req, str(exc), now)
            return []
        self._active[req.id] = req
        take = req.branches[: min(req.n, free)]
        return [Prefill(req.request), self._slots.start(req.id, take)]

    def _pause_for_urgent(self, now: float) -> list[BranchState]:
        """Pause the running branches ``WaitQueue.pause_quota`` asks for, chosen by each
        request's ``PauseRule``, and queue them to resume; return them."""
        paused: list[BranchState] = []
        for rid, count in self._waiting.pause_quota(now, self._active.values()).items():
            req = self._active[rid]
            try:
                chosen = choose_running(req, req.view(), req.policy.pause, "pause")
                paused.extend(chosen[:count])
            except PolicyFailure as exc:  # its own rule is broken: as a prune rule's
                self._requests.fail(req, str(exc), now)
        for branch in paused:
            req = self._active[branch.id.request_id]
            self._slots.pause(branch)
            self._waiting.add_branches(req, [branch])
            self._pauses += 1
        return paused

    def _running_requests(self) -> list[RequestState]:
        """Open requests with a branch decoding, in admission order: read from the
        batch's running branches once (asking each request walks its branches)."""
        ids = {bid.request_id for bid in self._slots.running}
        return [req for req in self._active.values() if req.id in ids]

    def _decode_command(self) -> Decode:
        running = self._running_requests()
        steps = self._checks.decode_steps(running)
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
                if isinstance(event, Decoded):
                    self._meter.steps.finished(now, event.output.steps)
                self._on_decode(event, now)
            elif isinstance(cmd, Score):
                self._on_score(cmd, event, now)
            elif isinstance(cmd, Pause):
                self._on_pause(cmd, event, now)
            else:  # Abort, ReleasePrefix, Finish
                self._slots.on_cleanup(cmd, event)

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
        self._slots.failed_cleanups += isinstance(event, Failed)
        self._slots.unaborted.update(cmd.branches)
        self._outbox.append(Abort(cmd.branches))
        why = event.reason if isinstance(event, Failed) else "skipped after an earlier failure"
        for rid in sorted(cmd.request_ids):
            req = self._pending.get(rid)
            if req is not None:
                self._requests.fail(req, f"pausing branches failed: {why}", now)

    def _on_prefill(self, cmd: Prefill, event: Event, now: float) -> None:
        req = self._active[cmd.request.id]
        if isinstance(event, Prefilled):
            req.prefilled = True
            reserved = self._slots.reserved
            self._waiting.add_branches(req, (b for b in req.branches if b.id not in reserved))
        elif isinstance(event, Failed):
            self._requests.fail(req, f"prefill failed: {event.reason}", now, event.refusal)
        else:
            raise SchedulerError(f"Prefill answered by {event!r}")

    def _on_start(self, cmd: StartBranches, event: Event, now: float) -> None:
        ids = [BranchId(cmd.request_id, spec.index) for spec in cmd.branches]
        req = self._pending.get(cmd.request_id)
        if req is None or req.ended:
            self._slots.unreserve(ids)
            if isinstance(event, Started):  # a driver that did not skip: undo at once
                self._outbox.append(Abort(tuple(ids)))
            return
        if isinstance(event, Started):
            self._slots.started(req, ids)
            return
        self._slots.unreserve(ids)
        if isinstance(event, Failed):
            reason = f"starting branches failed: {event.reason}"
            self._requests.fail(req, reason, now, event.refusal)
        elif isinstance(event, Skipped):
            self._requests.fail(req, "start skipped after an earlier failure", now)
        else:
            raise SchedulerError(f"StartBranches answered by {event!r}")

    def _on_decode(self, event: Event, now: float) -> None:
        if isinstance(event, Failed):
            involved = [r for r in self._active.values() if r.running]
            for req in involved:
                if event.request_ids is None or req.id in event.request_ids:
                    reason = f"decode failed: {event.reason}"
                    self._requests.fail(req, reason, now, event.refusal)
            return
        if not isinstance(event, Decoded):
            raise SchedulerError(f"Decode answered by {event!r}")
        out = event.output
        first_step = self._requests.step
        self._requests.step += out.steps
        advanced = out.request_steps  # None: every request advanced out.steps
        for req in self._running_requests():
            req.steps_since_check += out.steps if advanced is None else advanced.get(req.id, 0)
        retry: list[BranchId] = []
        for bid, delta in out.deltas.items():
            branch = self._slots.running.get(bid)
            if branch is None and self._slots.late_report(bid, delta.finish is not None):
                if delta.finish is None:  # ended here, still live there: abort again
                    retry.append(bid)
                continue
            if branch is None:
                raise SchedulerError(f"engine reported branch {bid} which is not running")
            branch.num_tokens += delta.new_tokens
            if delta.text:
                branch.chunks.append(delta.text)
            if branch.logprobs is not None:
                branch.logprobs.extend(delta.logprobs)
            if delta.finish is not None:
                req = self._active[bid.request_id]
                status = BranchStatus.FINISHED
                if delta.finish is not FinishReason.STOP:
                    status = BranchStatus.TRUNCATED
                else:
                    branch.stop_reason = delta.stop_reason
                end = first_step + (delta.end_offset or out.steps)
                self._requests.end_running(req, branch, status, end)
                req.newly_ended.append(branch)
        if retry:
            self._outbox.append(Abort(tuple(retry)))
        if not self._slots.running and self.config.admission is Admission.CHUNK:
            # Every branch ended before T steps: Algorithm 1 checks every request
            # after each Decode call, and the next Decode runs a full T steps.
            for req in self._active.values():
                req.steps_since_check = 0
        self._checks.want(req for req in self._active.values() if req.newly_ended or is_due(req))
        self._flush_checks(now)

    def _flush_checks(self, now: float) -> None:
        score, ready = self._checks.flush()
        if score is not None:
            self._outbox.append(score)
        self._requests.run_checks(ready, now)

    def _on_score(self, cmd: Score, event: Event, now: float) -> None:
        if not isinstance(event, Scored):
            raise SchedulerError(f"Score answered by {event!r}")
        checks = self._checks.answered(cmd.id)
        for request_id, reason in event.failures.items():
            req = self._pending.get(request_id)
            if req is not None:
                self._requests.fail(req, f"PRM failed: {reason}", now)
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
                self._requests.fail(req, str(exc), now)
        self._requests.run_checks(checks, now)
        # Overlapped: branches that ended meanwhile, and checks that came due, go next.
        self._checks.want(
            c.req for c in checks if not c.req.ended and (c.req.newly_ended or is_due(c.req))
        )
        self._flush_checks(now)
