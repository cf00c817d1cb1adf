"""Scoring a check by its last step only, and remembering each branch's rated steps.

The PRMs served from a prefix cache (``VLLMCachedPRM`` in this process, ``RemotePRM``
on ``vllm serve`` servers) ask one question per item: the reward of the last step of
its input, which ends at the branch's latest step separator. What they share lives
here, once: which items have a step to rate and the ids to send (``last_step_jobs``),
the reward of a pair of logits (``two_way_reward``), and ``StepMemory``, each
branch's latest reward of every step a check has rated, from which ``score``
aggregates. They differ only in how the inputs reach the model (their transport).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import attrs

from sart.prm.aggregate import check_finite
from sart.prm.base import ScoreItem
from sart.prm.window import Encoded
from sart.types import BranchId


@attrs.frozen
class Job:
    """One item with a step to rate: its position in the call, the ids to send (the
    input up to its last rating token) and the index of the step they rate."""

    position: int
    ids: list[int]
    step: int


def last_step_jobs(encoded: Sequence[Encoded]) -> list[Job]:
    """The items of a call that have a step to rate (an input with no step yet has
    nothing to send), each cut at its last step's rating token."""
    return [
        Job(i, enc.ids()[: enc.positions()[-1] + 1], enc.first_step + len(enc.segments) - 1)
        for i, enc in enumerate(encoded)
        if enc.segments
    ]


def two_way_reward(logits: Sequence[float]) -> float:
    """The good column of the softmax of a (bad, good) pair of logits, in float64."""
    bad, good = float(logits[0]), float(logits[1])
    top = max(bad, good)
    eb, eg = math.exp(bad - top), math.exp(good - top)
    return eg / (eb + eg)


class StepMemory:
    """Each branch's rated steps: step index -> the latest reward a check gave it.
    Thread-safe: checks of different requests may be scored side by side."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[BranchId, dict[int, float]] = {}

    def record(self, branch: BranchId, step: int, reward: float) -> None:
        with self._lock:
            self._steps.setdefault(branch, {})[step] = reward

    def collect(self, items: Sequence[ScoreItem]) -> list[list[float]]:
        """Per item, its branch's rated steps' rewards in step order. A final item's
        branch is forgotten (its last check); then ``PRMError`` names the requests
        with a reward that is not finite."""
        with self._lock:
            results = [
                [r for _, r in sorted(self._steps.get(item.branch, {}).items())] for item in items
            ]
            for item in items:
                if item.final:
                    self._steps.pop(item.branch, None)
        check_finite(items, results)
        return results

    def release(self, request_id: str) -> None:
        """Forget every branch of the request."""
        with self._lock:
            for branch in [b for b in self._steps if b.request_id == request_id]:
                del self._steps[branch]

    def __len__(self) -> int:
        """Branches remembered."""
        with self._lock:
            return len(self._steps)


__all__ = ["Job", "StepMemory", "last_step_jobs", "two_way_reward"]
