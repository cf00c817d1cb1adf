"""Calling a PRM with its failures confined to the requests at fault, and how many
calls a PRM takes side by side.

``score_items`` scores a ``Score``'s items in one call; when that call fails it
fails only the requests the ``PRMError`` names (``request_ids``), else retries
request by request so that only the request at fault fails -- extra PRM calls
only on failure. ``prm_workers`` and ``prm_replicas`` say how many calls a PRM
takes side by side (threads, processes, servers; priced replicas on a virtual
clock).
"""

from __future__ import annotations

from collections.abc import Sequence

from sart.commands import Scored
from sart.errors import PRMError
from sart.messages import ScoreItem
from sart.prm.base import PRM
from sart.types import BranchId


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
