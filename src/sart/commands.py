"""Commands the scheduler emits and the events that answer them (plain data).

The scheduler never runs a model; a driver carries out each command and
answers it with exactly one event, in the same order::

    Prefill        -> Prefilled | Failed | Skipped
    StartBranches  -> Started   | Failed | Skipped
    Decode         -> Decoded   | Failed
    Score          -> Scored
    Abort, ReleasePrefix, Finish -> Done | Failed

``Skipped`` answers a command the driver did not run because an earlier
command of the same request failed in the same batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from sart.engines.base import BranchSpec, StepOutput
from sart.prm.base import ScoreItem
from sart.request import Request
from sart.results import RequestResult
from sart.types import BranchId


@attrs.frozen
class Prefill:
    request: Request

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset((self.request.id,))


@attrs.frozen
class StartBranches:
    request_id: str
    branches: tuple[BranchSpec, ...]

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset((self.request_id,))


@attrs.frozen
class Decode:
    max_steps: int
    until_first_end: bool = False


@attrs.frozen
class Score:
    items: tuple[ScoreItem, ...]


@attrs.frozen
class Abort:
    branches: tuple[BranchId, ...]


@attrs.frozen
class ReleasePrefix:
    request_id: str


@attrs.frozen
class Finish:
    """Deliver a result to the user (the driver records it)."""

    result: RequestResult


Command = Prefill | StartBranches | Decode | Score | Abort | ReleasePrefix | Finish


@attrs.frozen
class Prefilled:
    prompt_tokens: int


@attrs.frozen
class Started:
    pass


@attrs.frozen
class Decoded:
    output: StepOutput


@attrs.frozen
class Scored:
    rewards: Mapping[BranchId, float]
    """Reward per scored branch (items of failed requests are absent)."""
    failures: Mapping[str, str] = attrs.field(factory=dict)
    """Request id -> reason, for requests whose items could not be scored."""


@attrs.frozen
class Failed:
    reason: str
    request_ids: frozenset[str] | None = None
    """The requests affected; ``None``: every request the command involved."""


@attrs.frozen
class Skipped:
    pass


@attrs.frozen
class Done:
    pass


Event = Prefilled | Started | Decoded | Scored | Failed | Skipped | Done
