"""The batch budget: the one owner of which branches hold a slot, and of the cleanups
the engine still owes.

A branch holds one of the ``B`` slots while it runs, while its start command is
in flight (*reserved*), and -- after the scheduler ended it -- while the engine
failed to abort it (*unaborted*: the engine may still decode it). Aborts and
prefix releases the engine failed are asked again when nothing else runs, a
bounded number of times, then given up on and counted.

Only ``Slots`` starts, forks, marks running, ends and pauses branches: it moves a
branch's status in and out of ``RUNNING`` together with its slot, so a request's
running count (``RequestState.running``, derived from its branches' statuses) and
the batch's (``len(running)``) can never disagree. Re-branching moves slots between
branches at every check; with one owner a fork cannot be counted twice or lost.
"""

from __future__ import annotations

from collections.abc import Sequence

from sart.commands import Abort, Command, Done, Event, Failed, ReleasePrefix, Skipped, StartBranches
from sart.errors import SchedulerError
from sart.messages import BranchSpec
from sart.state import BranchState, RequestState
from sart.types import BranchId, BranchStatus


class Slots:
    """Running, reserved and unaborted branches against the budget ``B``."""

    #: Aborts retried when nothing else runs, before the scheduler gives up on them.
    IDLE_ABORT_RETRIES = 3

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.running: dict[BranchId, BranchState] = {}
        self.reserved: set[BranchId] = set()  # start commands in flight
        # Branches the scheduler ended whose Abort the engine failed to carry out: the
        # engine may still decode them, so they hold a batch slot until it lets go.
        self.unaborted: set[BranchId] = set()
        self.unreleased: set[str] = set()  # prefixes not released because of those
        self.failed_cleanups = 0
        self._idle_retries = 0

    def free(self) -> int:
        """Slots free now (negative while the engine holds more than ``B``)."""
        return self.batch_size - len(self.running) - len(self.reserved) - len(self.unaborted)

    def start(self, request_id: str, branches: Sequence[BranchState]) -> StartBranches:
        """Reserve slots for ``branches`` and the command that starts (or resumes) them."""
        self.reserved.update(b.id for b in branches)
        specs = tuple(BranchSpec(index=b.index, seed=b.seed, resume=b.paused) for b in branches)
        for branch in branches:
            branch.paused = False
        return StartBranches(request_id=request_id, branches=specs)

    def fork(self, request_id: str, children: Sequence[BranchState]) -> StartBranches:
        """Reserve slots for forked children (``BranchState.parent`` set) and the command
        that starts them from their parents' state."""
        if len(children) > self.free():
            raise SchedulerError(f"{len(children)} forks asked for {self.free()} free slots")
        self.reserved.update(child.id for child in children)
        specs = tuple(
            BranchSpec(index=child.index, seed=child.seed, parent=child.parent)
            for child in children
        )
        return StartBranches(request_id=request_id, branches=specs)

    def started(self, req: RequestState, ids: Sequence[BranchId]) -> None:
        """The engine started (or resumed, or forked) ``ids`` of ``req``: they run now."""
        self.reserved.difference_update(ids)
        for bid in ids:
            branch = req.branches[bid.index]
            branch.status = BranchStatus.RUNNING
            self.running[bid] = branch

    def unreserve(self, ids: Sequence[BranchId]) -> None:
        """A start command was answered without starting ``ids`` (failed, skipped, or its
        request ended meanwhile): their reservations end."""
        self.reserved.difference_update(ids)

    def end(self, req: RequestState, branch: BranchState, status: BranchStatus, step: int) -> None:
        """End a running branch of ``req`` (pruned, stopped, failed, or completed in
        decode) at ``step``, and free its slot."""
        if branch.status is not BranchStatus.RUNNING or not status.is_ended:
            raise SchedulerError(f"branch {branch.id} ({branch.status}) cannot end as {status}")
        branch.status = status
        branch.end_step = step
        branch.ended_in = req.phase
        del self.running[branch.id]

    def pause(self, branch: BranchState) -> None:
        """Pause a running branch for more urgent work: it waits (to resume from its
        tokens) and frees its slot."""
        del self.running[branch.id]
        branch.status = BranchStatus.WAITING
        branch.paused = True

    def late_report(self, branch: BranchId, finished: bool) -> bool:
        """Whether a decode's report of ``branch`` is of one the scheduler ended but the
        engine still runs; if so its tokens are dropped, and it lets go of its slot
        once the engine says it finished (``False``: it must be running)."""
        if branch not in self.unaborted:
            return False
        if finished:
            self.unaborted.discard(branch)
        return True

    def retry_aborts(self) -> list[Command]:
        """Nothing else to do: ask again for aborts the engine failed, then for the
        prefixes they held up (a branch would otherwise stay live in the engine after
        the run), a bounded number of times."""
        if not (self.unaborted or self.unreleased):
            self._idle_retries = 0
            return []
        if self._idle_retries >= self.IDLE_ABORT_RETRIES:
            # The engine keeps refusing: given up, counted in failed_cleanups.
            self.unaborted.clear()
            self.unreleased.clear()
            return []
        self._idle_retries += 1
        cmds: list[Command] = []
        if self.unaborted:
            cmds.append(Abort(tuple(sorted(self.unaborted))))
        cmds.extend(ReleasePrefix(rid) for rid in sorted(self.unreleased))
        return cmds

    def on_cleanup(self, cmd: Command, event: Event) -> None:
        """Apply the answer to an ``Abort``, ``ReleasePrefix`` or ``Finish``."""
        if isinstance(event, Failed):
            self.failed_cleanups += 1
            if isinstance(cmd, Abort):  # asked again when the engine next reports them
                self.unaborted.update(cmd.branches)
            elif isinstance(cmd, ReleasePrefix):  # asked again when nothing else is to do
                self.unreleased.add(cmd.request_id)
        elif isinstance(event, Done):
            if isinstance(cmd, Abort):
                self.unaborted.difference_update(cmd.branches)
            elif isinstance(cmd, ReleasePrefix):
                self.unreleased.discard(cmd.request_id)
        elif isinstance(event, Skipped) and isinstance(cmd, ReleasePrefix):
            self.unreleased.add(cmd.request_id)  # after its branches' abort, retried
        else:
            raise SchedulerError(f"{type(cmd).__name__} answered by {event!r}")
