"""Read-only snapshots of a request and its branches, handed to policies.

Policies decide from these views and return plain data; they never see the
scheduler's mutable state, so a policy cannot corrupt it.
"""

from __future__ import annotations

import attrs

from sart.types import BranchStatus, Phase


@attrs.frozen
class Load:
    """The server's load as a policy sees it, when a request is admitted and at each of
    its checks: counts the scheduler keeps, the same on every engine."""

    waiting_requests: int
    """Requests that have arrived and are not admitted yet (not counting this one)."""
    waiting_branches: int
    """Branches of admitted requests waiting for a batch slot."""
    running_branches: int
    """Branches holding a batch slot."""
    budget: int
    """``B``: the batch slots, the branches that may run at once."""
    active_requests: int
    """Admitted requests not finished (this one included once admitted)."""
    arrival_rate: float | None
    """Arrivals per unit of time over the recent ones (the last ``RATE_WINDOW``);
    ``None`` before two have arrived, or while those arrived at one instant."""
    waited: float
    """This request's time since its arrival."""
    prm_waiting: int = 0
    """Requests whose due check waits for the PRM to take it (every ``Score`` it may
    have in flight is out): the PRM, not the batch, is what holds them up."""
    kv_tokens: int | None = None
    """KV-cache tokens held, as the engine last reported (``None``: not reported)."""
    kv_capacity: int | None = None
    """KV-cache tokens the engine can hold, if it says."""
    step_fixed: float | None = None
    """Seconds a decode step costs whatever its rows, as fitted from the steps run so
    far (``sart.scheduler.step_cost``; ``None`` until the batch's size has varied, and
    while steps take under its ``MIN_STEP``)."""
    step_per_row: float | None = None
    """Seconds each running branch adds to a decode step, by the same fit."""

    @property
    def free_slots(self) -> int:
        """Batch slots neither running nor wanted by a waiting branch."""
        return max(0, self.budget - self.running_branches - self.waiting_branches)

    @property
    def kv_use(self) -> float | None:
        """KV held over capacity, when both are known."""
        if self.kv_tokens is None or not self.kv_capacity:
            return None
        return self.kv_tokens / self.kv_capacity

    def rows_cost(self, rows: int) -> float | None:
        """What ``rows`` running branches add to a decode step, as a share of its
        fixed cost (``None``: not fitted yet; ``inf`` when a step is all rows)."""
        if self.step_fixed is None or self.step_per_row is None:
            return None
        added = self.step_per_row * rows
        if self.step_fixed <= 0:
            return float("inf") if added > 0 else 0.0
        return added / self.step_fixed

    def rows_within(self, budget: float | None) -> bool:
        """Whether the running branches add at most ``budget`` of a step's fixed cost
        (true without a budget, or before the step cost is fitted)."""
        cost = self.rows_cost(self.running_branches)
        return budget is None or cost is None or cost <= budget


RATE_WINDOW = 32
"""Arrivals ``Load.arrival_rate`` is measured over."""


@attrs.frozen
class Limits:
    """The pruning limits of the paper's per-request record (Algorithm 1, line 24)."""

    threshold: float | None
    """Branches whose reward is below this may be pruned (``None``: no threshold).
    Advisory: the prune rule's ``choose`` reads it; the scheduler does not."""
    max_num_pruned: int
    """How many branches of the request may be pruned in total. Enforced by the
    scheduler (never more than ``n - 1``); once spent, running branches are no
    longer scored for pruning."""


@attrs.frozen
class BranchView:
    """One branch as a policy sees it."""

    index: int
    status: BranchStatus
    num_tokens: int
    """Tokens generated so far."""
    reward: float | None
    """Latest PRM reward (aggregated over steps), ``None`` if never scored."""
    text: str
    """Generated text so far."""
    end_step: int | None
    """Scheduler decode step at which the branch ended (``None`` while live)."""
    parent: int | None = None
    """A fork's parent branch (``None``: started from the prompt)."""
    inherited: int = 0
    """Of ``num_tokens``, those a fork took over from its parent."""
    scored_at: int | None = None
    """Its tokens when ``reward`` was taken (``None``: not scored itself). A completed
    branch's reward is final once this is ``num_tokens``: with overlapped checks
    its final reward comes a check after it completes."""
    answer: str | None = None
    """A completed branch's answer (the policy's ``extract`` of its text), in the views
    a stop rule that reads answers gets (``StopRule.needs_answers``); ``None``
    elsewhere and while the branch runs."""

    @property
    def is_running(self) -> bool:
        """Whether it is decoding now (not waiting, paused or ended)."""
        return self.status is BranchStatus.RUNNING

    @property
    def is_completed(self) -> bool:
        """Whether it ended on its own (an answer or its token cap), not pruned or stopped."""
        return self.status.is_completed


@attrs.frozen
class RequestView:
    """One request as a policy sees it, at a check after a decode chunk."""

    request_id: str
    n: int
    phase: Phase
    limits: Limits
    num_completed: int
    num_pruned: int
    branches: tuple[BranchView, ...]
    """Every branch, by index (waiting ones included): the ``n`` started from the prompt,
    then the forks of a re-branching policy, in the order they were made."""
    load: Load | None = None
    """The server's load at this check (``None`` where no scheduler measured it, as in
    a view built by hand)."""
    max_tokens: int | None = None
    """The request's cap on a branch's tokens (``SamplingSettings.max_tokens``)."""
    seed: int = 0
    """The request's sampling seed: a rule that draws (systematic resampling) seeds its
    draws from it, so a run is deterministic given its seeds."""

    @property
    def live(self) -> tuple[BranchView, ...]:
        """Branches running or waiting for a slot."""
        return tuple(b for b in self.branches if not b.status.is_ended)

    @property
    def generated_tokens(self) -> int:
        """Tokens the request's branches generated so far (a fork's inherited prefix
        counted once, in its parent)."""
        return sum(b.num_tokens - b.inherited for b in self.branches)

    @property
    def running(self) -> tuple[BranchView, ...]:
        """Its branches decoding now."""
        return tuple(b for b in self.branches if b.is_running)

    @property
    def others_waiting(self) -> int:
        """Batch slots other work waits for (0 without a ``load``): other requests'
        waiting branches, and one per queued request."""
        if self.load is None:
            return 0
        own = sum(b.status is BranchStatus.WAITING for b in self.branches)
        return max(0, self.load.waiting_branches - own) + self.load.waiting_requests

    @property
    def completed(self) -> tuple[BranchView, ...]:
        return tuple(b for b in self.branches if b.status.is_completed)

    @property
    def first_completed(self) -> BranchView | None:
        """The earliest-ended completed branch; ties go to the lowest index."""
        done = self.completed
        if not done:
            return None
        return min(done, key=completion_order)


def completion_order(branch: BranchView) -> tuple[int, int]:
    """Sort key: earlier end first, then lower index."""
    return (branch.end_step if branch.end_step is not None else 0, branch.index)
