"""The scheduler's mutable per-request and per-branch records, and their snapshots.

Only ``Scheduler`` mutates these. Policies see ``BranchView``/``RequestView``
snapshots; users see ``RequestMeta`` and ``RequestResult``.
"""

from __future__ import annotations

import attrs

from sart.policies.base import Policy
from sart.request import Request
from sart.results import BranchOutcome, Timings
from sart.types import BranchId, BranchStatus, Phase
from sart.views import BranchView, Limits, Load, RequestView


@attrs.frozen
class RequestMeta:
    """The paper's per-request record (Algorithm 1, line 24), plus timestamps."""

    request_id: str
    phase: Phase
    threshold: float | None
    max_num_pruned: int
    num_completed: int
    num_pruned: int
    arrival: float
    scheduled: float | None
    """When the request was prefilled (first scheduled)."""
    finished: float | None


class BranchState:
    """One branch, mutable, owned by the scheduler."""

    __slots__ = (
        "chunks",
        "end_step",
        "ended_in",
        "id",
        "num_tokens",
        "paused",
        "reward",
        "reward_history",
        "seed",
        "status",
    )

    def __init__(self, branch_id: BranchId, seed: int) -> None:
        self.id = branch_id
        self.seed = seed
        self.status = BranchStatus.WAITING
        self.num_tokens = 0
        # Text arrives in pieces; joined lazily (see ``text``) to keep decoding cheap.
        self.chunks: list[str] = []
        self.reward: float | None = None
        # (tokens when scored, reward): what a trace records for this branch.
        self.reward_history: list[tuple[int, float]] = []
        self.end_step: int | None = None
        self.ended_in: Phase | None = None
        # Paused for a more urgent request (WAITING meanwhile): it resumes from its tokens.
        self.paused = False

    @property
    def index(self) -> int:
        return self.id.index

    @property
    def text(self) -> str:
        if len(self.chunks) > 1:
            self.chunks[:] = ["".join(self.chunks)]
        return self.chunks[0] if self.chunks else ""

    def view(self) -> BranchView:
        return BranchView(
            index=self.id.index,
            status=self.status,
            num_tokens=self.num_tokens,
            reward=self.reward,
            text=self.text,
            end_step=self.end_step,
        )

    def outcome(self, answer: str | None) -> BranchOutcome:
        return BranchOutcome(
            index=self.id.index,
            status=self.status,
            num_tokens=self.num_tokens,
            reward=self.reward,
            answer=answer,
            reward_history=tuple(self.reward_history),
            ended_in=self.ended_in,
        )


class RequestState:
    """One admitted request, mutable, owned by the scheduler."""

    __slots__ = (
        "branches",
        "ended",
        "finished_at",
        "in_score",
        "limits",
        "load",
        "newly_ended",
        "num_completed",
        "num_pruned",
        "phase",
        "policy",
        "prefilled",
        "prm_items",
        "request",
        "running",
        "scheduled_at",
        "steps_since_check",
    )

    def __init__(self, request: Request) -> None:
        self.request = request
        self.policy: Policy = request.policy
        n = self.policy.n
        seed = request.seed
        self.branches = [BranchState(BranchId(request.id, j), seed + j) for j in range(n)]
        self.phase = Phase.EXPLORE
        self.limits = Limits(threshold=None, max_num_pruned=n - 1)
        self.num_completed = 0
        self.num_pruned = 0
        self.running = 0
        self.steps_since_check = 0
        self.prm_items = 0
        self.prefilled = False
        self.ended = False
        self.scheduled_at: float | None = None
        self.finished_at: float | None = None
        # Branches that ended in decode since the last check, in report order.
        self.newly_ended: list[BranchState] = []
        # A check of this request waits for the rewards of the Score in flight.
        self.in_score = False
        # The server's load as of this request's admission or latest check.
        self.load: Load | None = None

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def n(self) -> int:
        return self.policy.n

    def has_waiting(self) -> bool:
        return any(b.status is BranchStatus.WAITING for b in self.branches)

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.request.id,
            n=self.policy.n,
            phase=self.phase,
            limits=self.limits,
            num_completed=self.num_completed,
            num_pruned=self.num_pruned,
            branches=tuple(b.view() for b in self.branches),
            load=self.load,
        )

    def meta(self) -> RequestMeta:
        return RequestMeta(
            request_id=self.request.id,
            phase=self.phase,
            threshold=self.limits.threshold,
            max_num_pruned=self.limits.max_num_pruned,
            num_completed=self.num_completed,
            num_pruned=self.num_pruned,
            arrival=self.request.arrival,
            scheduled=self.scheduled_at,
            finished=self.finished_at,
        )

    def timings(self, now: float) -> Timings:
        return Timings(arrival=self.request.arrival, scheduled=self.scheduled_at, finished=now)
