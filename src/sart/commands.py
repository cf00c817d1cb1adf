"""Commands the scheduler emits and the events that answer them (plain data).

The scheduler never runs a model; a driver carries out each command and
answers it with exactly one event::

    Prefill        -> Prefilled | Failed | Skipped
    StartBranches  -> Started   | Failed | Skipped
    Decode         -> Decoded   | Failed
    Score          -> Scored
    Abort, Finish  -> Done | Failed
    Pause          -> Done | Failed | Skipped
    ReleasePrefix  -> Done | Failed | Skipped

``Skipped`` answers a command the driver did not run because an earlier
command of the same request failed in the same batch (a prefix is not
released while an abort of its branches failed; the scheduler asks again).

Every command the scheduler emits carries an ``id`` (unique, increasing), and
an answer names the id it answers, so answers may come in any order: with
``Scoring.OVERLAPPED`` a ``Score`` stays in flight while later batches of
``Decode`` and the rest are carried out and answered. Ids take no part in
equality, so ``Decode(max_steps=4)`` compares equal to the command emitted.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from sart.messages import BranchSpec, ScoreItem, StepOutput
from sart.request import Request
from sart.results import RequestResult
from sart.types import BranchId


def _id() -> int:
    return attrs.field(default=0, eq=False, kw_only=True)  # type: ignore[no-any-return]


def _of_request_id(command: StartBranches | ReleasePrefix) -> frozenset[str]:
    return frozenset((command.request_id,))


def _of_branches(command: Abort | Pause) -> frozenset[str]:
    return frozenset(b.request_id for b in command.branches)


@attrs.frozen
class Prefill:
    request: Request
    id: int = _id()

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset((self.request.id,))


@attrs.frozen
class StartBranches:
    request_id: str
    branches: tuple[BranchSpec, ...]
    id: int = _id()

    request_ids = property(_of_request_id)


@attrs.frozen
class Decode:
    max_steps: int
    until_first_end: bool = False
    id: int = _id()


@attrs.frozen
class Score:
    items: tuple[ScoreItem, ...]
    id: int = _id()


@attrs.frozen
class Abort:
    branches: tuple[BranchId, ...]
    id: int = _id()

    request_ids = property(_of_branches)


@attrs.frozen
class Pause:
    """Pause these running branches: the engine frees their KV and keeps their tokens;
    they resume later with ``BranchSpec(resume=True)``."""

    branches: tuple[BranchId, ...]
    id: int = _id()

    request_ids = property(_of_branches)


@attrs.frozen
class ReleasePrefix:
    request_id: str
    id: int = _id()

    request_ids = property(_of_request_id)


@attrs.frozen
class Finish:
    """Deliver a result to the user (the driver records it)."""

    result: RequestResult
    id: int = _id()


Command = Prefill | StartBranches | Decode | Score | Abort | Pause | ReleasePrefix | Finish


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
class Refusal:
    """An engine refused a request for what it asks (``RequestRefused``: a prompt over
    the context), not for a fault of its own; a server answers it 400."""

    field: str | None = None
    """The request field at fault, if the engine names one (``RequestRefused.field``)."""


@attrs.frozen
class Failed:
    reason: str
    request_ids: frozenset[str] | None = None
    """The requests affected; ``None``: every request the command involved."""
    refusal: Refusal | None = None
    """Set when the engine refused the requests for what they ask."""


@attrs.frozen
class Skipped:
    pass


@attrs.frozen
class Done:
    pass


Event = Prefilled | Started | Decoded | Scored | Failed | Skipped | Done
