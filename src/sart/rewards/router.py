"""``RewardRouter``: which reward source scores each request a driver serves.

A request's branch rewards come from its policy's own source (``Policy.reward``,
e.g. a ``ConfidenceScorer`` reading the policy's log-probabilities) or, by
default, from the driver's PRM. ``RewardRouter`` keeps that mapping for a
driver: it groups a ``Score``'s items by source, asks each source for the
log-probabilities it reads, hands sources that read tokens their requests'
deltas, and releases a request's state in its source when the engine lets go of
the request (or when it finishes without ever being prefilled).

Each source is called through ``sart.rewards.isolation.score_items``, so a
failure fails only the requests at fault. No engine, no I/O of its own (the
PRMs it calls may do theirs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from sart.commands import Scored
from sart.messages import ScoreItem, StepOutput
from sart.prm.base import PRM
from sart.request import Request
from sart.rewards.isolation import score_items
from sart.types import BranchId, SamplingSettings


class RewardRouter:
    """The reward source of each request a driver serves: its policy's, else ``prm``."""

    def __init__(self, prm: PRM | None) -> None:
        self.prm = prm
        self._sources: dict[str, Any] = {}  # requests whose policy brings its own source
        self._held: set[str] = set()  # requests whose prefix the engine holds

    def add(self, request: Request) -> None:
        """Route ``request``: to its policy's own source, if it has one."""
        if request.policy.reward is not None:
            self._sources[request.id] = request.policy.reward

    def source_of(self, request_id: str) -> Any:
        """Where a request's rewards come from: its policy's source, else the PRM."""
        return self._sources.get(request_id, self.prm)

    def score(self, items: Sequence[ScoreItem]) -> Scored:
        """Each item scored by its request's source (one call per source)."""
        by_source: dict[int, tuple[Any, list[ScoreItem]]] = {}
        for item in items:
            source = self.source_of(item.branch.request_id)
            assert source is not None  # drivers refuse requests that need one
            by_source.setdefault(id(source), (source, []))[1].append(item)
        if len(by_source) == 1:
            source, group = next(iter(by_source.values()))
            return score_items(source, group)
        rewards: dict[BranchId, float] = {}
        failures: dict[str, str] = {}
        for source, group in by_source.values():
            scored = score_items(source, group)
            rewards.update(scored.rewards)
            failures.update(scored.failures)
        return Scored(rewards=rewards, failures=failures)

    def sampling(self, request: Request) -> SamplingSettings:
        """The request's sampling, asking for the log-probabilities its reward source
        reads (``logprobs_wanted``), if it reads any."""
        wanted = getattr(self.source_of(request.id), "logprobs_wanted", None)
        sampling = request.sampling
        if wanted is None or (sampling.logprobs is not None and sampling.logprobs >= wanted):
            return sampling
        return attrs.evolve(sampling, logprobs=wanted)

    def observe(self, output: StepOutput) -> None:
        """Hand each reward source that reads tokens (``observe``) its requests' deltas."""
        routed: dict[int, tuple[Any, dict[BranchId, Any]]] = {}
        for bid, delta in output.deltas.items():
            source = self.source_of(bid.request_id)
            if getattr(source, "observe", None) is not None:
                routed.setdefault(id(source), (source, {}))[1][bid] = delta
        for source, deltas in routed.values():
            source.observe(attrs.evolve(output, deltas=deltas))

    def hold(self, request_id: str) -> None:
        """The engine holds ``request_id``'s prefix: its source is released with it."""
        self._held.add(request_id)

    def release(self, request_id: str) -> None:
        """The engine let go of ``request_id``: so does its source."""
        source = self._sources.pop(request_id, self.prm)
        self._held.discard(request_id)
        release = getattr(source, "release", None)
        if release is not None:
            release(request_id)

    def finished(self, request_id: str) -> None:
        """``request_id`` finished; never prefilled (or released), it has nothing left
        to release, and is forgotten."""
        if request_id not in self._held:
            self._sources.pop(request_id, None)
