"""The PRM contract: score (prompt, partial response) pairs of many branches at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from sart.messages import ScoreItem, validate_reward


@runtime_checkable
class PRM(Protocol):
    """A process reward model.

    ``score`` returns one reward in [0, 1] per item, in order. Raising
    ``PRMError(request_ids=...)`` confines the failure to those requests; any
    other exception makes the driver retry request by request to find the
    failing one. An optional ``release(request_id)`` lets a PRM drop state it
    keeps for a request (e.g. an incremental KV cache) when the request ends, and
    an optional ``cancel()`` cuts its calls in flight short (each raising
    ``PRMError``): ``sart serve`` calls it when it stops (``RemotePRM``'s does not
    wait for a hung server).
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


__all__ = ["PRM", "PricedPRM", "ScoreItem", "validate_reward"]
