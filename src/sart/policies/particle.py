"""Particle filtering (as in "Rollout Roulette", Puri et al. 2025, and its_hub) on
SART's scheduler: the published re-branching baseline.

``n`` particles (branches) decode; at every check (``T`` tokens, a reasoning
step's worth) the PRM scores the running ones and they are resampled by weight
with systematic resampling: a particle drawn ``k`` times goes on and is forked
``k - 1`` times, one drawn 0 times is pruned (its KV freed at once). The weights
are the rewards themselves (a PRM's probability that the prefix leads to a right
answer, the particle filter's likelihood) or, with a ``temperature``,
``softmax(reward / temperature)``. Completed particles leave the population (the
budget shrinks with every solution, as in Rebase); the answer is the
best-rewarded completed one.

As ``RewardBalance``, the draws exactly fill the slots the prunes free, so the
branch budget ``B`` holds and no other request loses a slot. The draw is seeded by
the request's seed and its branch count: a run is deterministic given its seeds.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping

import attrs

from sart.policies.base import PruneRule
from sart.policies.rebranch import _check_temperature, draw_uniform, parent_weights, systematic
from sart.views import Limits, RequestView


@attrs.frozen
class Resample(PruneRule):
    """Systematic resampling of the running particles by reward (module docstring)."""

    temperature: float | None = attrs.field(default=None, validator=_check_temperature)
    """``None``: weights are the rewards; else ``softmax(reward / temperature)``."""

    def start(self, n: int) -> Limits:
        # Prunes are replaced by forks: the paper's cap on prunes does not apply (the
        # scheduler still never prunes every branch).
        return Limits(threshold=None, max_num_pruned=sys.maxsize)

    def draws(self, request: RequestView) -> dict[int, int]:
        """Each running particle's draws (``{}`` while one has no reward yet)."""
        running = request.running
        if not running or any(b.reward is None or math.isnan(b.reward) for b in running):
            return {}
        weights = parent_weights(running, self.temperature)
        return systematic(running, weights, len(running), draw_uniform(request))

    def choose(self, request: RequestView) -> Iterable[int]:
        draws = self.draws(request)
        dropped = [b for b in request.running if draws.get(b.index, 1) == 0]
        return [b.index for b in sorted(dropped, key=lambda b: (b.reward, b.index))]

    def fork(self, request: RequestView) -> Mapping[int, int]:
        return {index: k - 1 for index, k in self.draws(request).items() if k >= 2}
