"""What a run returns: one ``RequestResult`` per request, with per-branch outcomes."""

from __future__ import annotations

import attrs

from sart.types import BranchStatus, Phase, RequestStatus


@attrs.frozen
class BranchOutcome:
    """How one branch ended."""

    index: int
    status: BranchStatus
    num_tokens: int
    """Tokens generated before it ended."""
    reward: float | None
    """Last PRM reward it received, ``None`` if never scored."""
    answer: str | None
    """Extracted answer for completed branches, else ``None``."""
    ended_in: Phase | None
    """The request's phase when the branch ended (``None`` if it never started)."""
    reward_history: tuple[tuple[int, float], ...] = ()
    """Every PRM score it received: ``(tokens generated when scored, reward)``."""


@attrs.frozen
class Timings:
    """Per-request timestamps on the run's clock, and the latencies derived from them."""

    arrival: float
    scheduled: float | None
    """When the request was prefilled (first scheduled); ``None`` if it never was."""
    finished: float

    @property
    def queueing(self) -> float:
        """Waiting before prefill."""
        start = self.scheduled if self.scheduled is not None else self.finished
        return start - self.arrival

    @property
    def inference(self) -> float:
        """From prefill to the final answer."""
        return self.finished - self.scheduled if self.scheduled is not None else 0.0

    @property
    def end_to_end(self) -> float:
        return self.finished - self.arrival


@attrs.frozen
class RequestResult:
    """The outcome of one request."""

    request_id: str
    status: RequestStatus
    chosen: int | None
    """Index of the selected branch; ``None`` if the request failed."""
    text: str | None
    """Full text of the selected branch."""
    answer: str | None
    """Answer extracted from ``text`` by the policy's ``extract``."""
    branches: tuple[BranchOutcome, ...]
    timings: Timings
    reason: str | None = None
    """Why the request failed (``None`` when it completed)."""
    refused: bool = False
    """It failed for what it asks, which the engine refused (``RequestRefused``: a
    prompt that does not fit the model's context), not for a fault: a server
    answers it 400."""
    policy: str = ""
    """The policy's name."""
    prm_items: int = 0
    """Branch scorings requested for this request: from the PRM, or from its policy's own
    reward source (``Policy.reward``, e.g. confidence) when it has one."""
    prm_seconds: float = 0.0
    """PRM time spent on this request's items (a call's time shared by item count)."""
    prm_wait_seconds: float = 0.0
    """Time this request's running branches could not decode because the driver
    was waiting for the PRM (blocking checks wait for every check; overlapped
    ones only when nothing else can run)."""

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.COMPLETED

    @property
    def num_completed(self) -> int:
        return sum(1 for b in self.branches if b.status.is_completed)

    @property
    def num_pruned(self) -> int:
        return sum(1 for b in self.branches if b.status is BranchStatus.PRUNED)

    @property
    def generated_tokens(self) -> int:
        return sum(b.num_tokens for b in self.branches)
