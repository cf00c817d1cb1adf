"""Prune rules: which running branches to drop at a check."""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from sart.errors import config_check, int_at_least
from sart.policies.base import PruneRule
from sart.views import BranchView, Limits, RequestView, completion_order


def below(request: RequestView, threshold: float | None) -> list[int]:
    """Running branches rewarded below ``threshold``, lowest first (then by index);
    none without a threshold. Unscored and NaN-rewarded branches are never below."""
    if threshold is None:
        return []
    low = [
        b
        for b in request.running
        if b.reward is not None and not math.isnan(b.reward) and b.reward < threshold
    ]
    low.sort(key=lambda b: (b.reward, b.index))
    return [b.index for b in low]


@attrs.frozen
class NoPrune(PruneRule):
    """Never prune. The PRM is not called for running branches."""


@attrs.frozen
class TwoPhasePrune(PruneRule):
    """The paper's two-phase dynamic pruning (section 3, Algorithm 1).

    Phase 1 (explore): prune running branches whose reward is below ``alpha``,
    at most ``beta`` of them. When the request's first branch completes
    (several in one check: the earliest-ended, then the lowest index), phase 2
    (exploit) begins: the threshold becomes that branch's reward and up to
    ``n - 1`` branches may be pruned in total. Lowest rewards are pruned first.
    """

    alpha: float = attrs.field()
    beta: int = attrs.field(validator=int_at_least(0))

    @alpha.validator
    def _check_alpha(self, _attr: attrs.Attribute, value: float) -> None:
        config_check(
            isinstance(value, (int, float)) and 0.0 <= value <= 1.0, "alpha", value, "in [0, 1]"
        )

    def validate(self, n: int) -> None:
        config_check(self.beta < n, "beta", self.beta, f"< n={n}")

    def start(self, n: int) -> Limits:
        return Limits(threshold=float(self.alpha), max_num_pruned=self.beta)

    def enter_exploit(self, limits: Limits, first: BranchView, n: int) -> Limits:
        # A first completion that was never scored (cannot happen when the
        # scheduler scores completions for this rule) keeps the old threshold.
        threshold = first.reward if first.reward is not None else limits.threshold
        return Limits(threshold=threshold, max_num_pruned=n - 1)

    def choose(self, request: RequestView) -> Iterable[int]:
        return below(request, request.limits.threshold)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolated linearly between
    the closest ranks (numpy's default, which DeepConf's reference code uses)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@attrs.frozen
class WarmupThreshold(PruneRule):
    """DeepConf-online's stopping rule (Fu et al., 2025, Algorithm 2) on sart's checks.

    The first ``warmup`` branches to complete are the warm-up traces; the
    threshold is the ``100 - keep`` percentile of their rewards (DeepConf-low
    keeps the top 10%: ``keep=10``; DeepConf-high the top 90%: ``keep=90``).
    From then on every running branch whose reward is below it is pruned at
    the next check, lowest first. With a confidence reward source
    (``LowestGroupConfidence``) that is DeepConf's rule: a trace stops once a
    window's group confidence drops below the threshold (here, at the first
    check after it does, and by aborting the branch, which frees its KV).
    Before the warm-up completes nothing is pruned; up to ``n - 1`` branches may
    be pruned in all.
    """

    warmup: int = attrs.field(validator=int_at_least(1))
    keep: float = attrs.field(default=90.0)

    @keep.validator
    def _check_keep(self, _attr: attrs.Attribute, value: float) -> None:
        config_check(
            isinstance(value, (int, float)) and 0.0 < value <= 100.0, "keep", value, "in (0, 100]"
        )

    def validate(self, n: int) -> None:
        config_check(self.warmup < n, "warmup", self.warmup, f"< n={n}")

    def threshold(self, request: RequestView) -> float | None:
        """The warm-up threshold, once ``warmup`` branches have completed and have their
        final rewards (else ``None``: with overlapped checks a completed branch's last
        reward may be of a prefix until the next check scores the whole of it)."""
        done = sorted(request.completed, key=completion_order)[: self.warmup]
        if len(done) < self.warmup or any(b.scored_at != b.num_tokens for b in done):
            return None
        rewards = [b.reward for b in done if b.reward is not None and not math.isnan(b.reward)]
        if not rewards:
            return None
        return percentile(rewards, 100.0 - self.keep)

    def choose(self, request: RequestView) -> Iterable[int]:
        return below(request, self.threshold(request))
