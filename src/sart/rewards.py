"""Reward sources: which one scores each request, and scoring on it with failures confined.

A request's branch rewards come from its policy's own source (``Policy.reward``,
e.g. a ``ConfidenceScorer`` reading the policy's log-probabilities) or, by
default, from the driver's PRM. ``RewardRouter`` keeps that mapping for a
driver: it groups a ``Score``'s items by source, asks each source for the
log-probabilities it reads, hands sources that read tokens their requests'
deltas, and releases a request's state in its source when the engine lets go of
the request (or when it finishes without ever being prefilled).

``score_items`` scores items in one call and confines a failure to the requests
at fault (``PRMError.request_ids``, else by retrying request by request);
``prm_workers`` and ``prm_replicas`` say how many calls a PRM takes side by side.
Pure: no engine, no I/O of its own (the PRMs it calls may do theirs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from sart.commands import Scored
from sart.errors import PRMError
from sart.messages import ScoreItem, StepOutput
from sart.prm.base import PRM
from sart.request import Request
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
            source.observe(StepOutput(steps=output.steps, deltas=deltas))

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


def prm_workers(prm: object) -> int:
    """How many calls ``prm`` takes side by side (its ``workers``; 1 if it does not
    say): the driver keeps that many overlapped ``Score`` commands in flight."""
    workers = getattr(prm, "workers", 1)
    return workers if isinstance(workers, int) and workers >= 1 else 1


def prm_replicas(prm: object) -> int:
    """On a virtual clock, how many calls a priced PRM serves at once (its
    ``replicas``; 1 if it does not say)."""
    replicas = getattr(prm, "replicas", 1)
    return replicas if isinstance(replicas, int) and replicas >= 1 else 1


def score_items(prm: PRM, items: Sequence[ScoreItem]) -> Scored:
    """Score ``items`` in one PRM call; on failure, confine it to the requests at fault
    (``PRMError.request_ids``, else by retrying request by request)."""
    groups: dict[str, list[ScoreItem]] = {}
    for item in items:
        groups.setdefault(item.branch.request_id, []).append(item)
    rewards: dict[BranchId, float] = {}
    failures: dict[str, str] = {}
    _score_groups(prm, list(groups.items()), rewards, failures)
    return Scored(rewards=rewards, failures=failures)


def _score_groups(
    prm: PRM,
    groups: list[tuple[str, list[ScoreItem]]],
    rewards: dict[BranchId, float],
    failures: dict[str, str],
) -> None:
    batch = [item for _, group in groups for item in group]
    try:
        values = list(prm.score(batch))
        if len(values) != len(batch):
            raise PRMError(f"PRM returned {len(values)} rewards for {len(batch)} items")
    except AssertionError:
        raise
    except PRMError as exc:
        named = [g for g in groups if g[0] in exc.request_ids]
        if not named:
            _isolate(prm, groups, rewards, failures, exc)
            return
        for rid, _ in named:
            failures[rid] = str(exc)
        rest = [g for g in groups if g[0] not in exc.request_ids]
        if rest:
            _score_groups(prm, rest, rewards, failures)
        return
    except Exception as exc:
        _isolate(prm, groups, rewards, failures, exc)
        return
    rewards.update(zip((item.branch for item in batch), values))


def _isolate(
    prm: PRM,
    groups: list[tuple[str, list[ScoreItem]]],
    rewards: dict[BranchId, float],
    failures: dict[str, str],
    exc: Exception,
) -> None:
    # A failure we cannot attribute: retry request by request so that only the
    # request at fault fails. Costs extra PRM calls only on failure.
    if len(groups) == 1:
        failures[groups[0][0]] = f"{type(exc).__name__}: {exc}"
        return
    for group in groups:
        _score_groups(prm, [group], rewards, failures)
