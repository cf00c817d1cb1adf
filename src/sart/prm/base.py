"""The PRM contract: score (prompt, partial response) pairs of many branches at once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from sart.errors import PRMError
from sart.types import BranchId, Prompt


@attrs.frozen
class ScoreItem:
    """One branch to score."""

    branch: BranchId
    prompt: Prompt
    text: str
    """The branch's response so far."""
    num_tokens: int
    """Tokens generated so far (lets a PRM or a script key on progress)."""
    final: bool
    """True when the branch has completed (this is its final score)."""


@runtime_checkable
class PRM(Protocol):
    """A process reward model.

    ``score`` returns one reward in [0, 1] per item, in order. Raising
    ``PRMError(request_ids=...)`` confines the failure to those requests; any
    other exception makes the driver retry request by request to find the
    failing one. An optional ``release(request_id)`` lets a PRM drop state it
    keeps for a request (e.g. an incremental KV cache) when the request ends.
    """

    def score(self, items: Sequence[ScoreItem]) -> Sequence[float]: ...


@runtime_checkable
class PricedPRM(Protocol):
    """A PRM whose time is modelled rather than measured (the simulator's).

    On a virtual clock the driver calls ``cost(items)`` once per scoring call,
    just before ``score(items)``, and lets the call take that many seconds of
    virtual time: the clock advances by it when checks block decoding or when
    ``shares_engine`` (the PRM runs on the policy's accelerator, so the two
    cannot work at once); otherwise the rewards arrive that much later while
    decoding goes on. ``cost`` may keep state (e.g. how much of each branch an
    incremental PRM has already read).
    """

    shares_engine: bool

    def score(self, items: Sequence[ScoreItem]) -> Sequence[float]: ...

    def cost(self, items: Sequence[ScoreItem]) -> float: ...


def validate_reward(value: object, branch: BranchId) -> float:
    """Return ``value`` as a float in [0, 1], or raise ``PRMError`` naming the branch."""
    try:
        reward = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise PRMError(
            f"PRM returned {value!r} for branch {branch}, not a number", [branch.request_id]
        ) from None
    if math.isnan(reward) or not 0.0 <= reward <= 1.0:
        raise PRMError(
            f"PRM returned reward {reward!r} for branch {branch}; rewards must be in [0, 1]",
            [branch.request_id],
        )
    return reward
