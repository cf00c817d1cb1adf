"""Branching by load: choose a request's ``n`` when it is admitted, and shed branches
under pressure.

A fixed ``n`` is right at one load only: idle, eight branches cost nobody anything
and cut the over-thinking tail; busy, every extra branch is someone's queueing
time. Both rules read ``Load`` (``sart.views``), the counts the scheduler keeps,
so they behave the same on every engine.

- ``BranchByLoad`` (an ``AdmitRule``): at admission, ``n`` from the batch slots
  that are free, shared with the requests still queued, between a floor and the
  policy's own ``n`` (the ceiling).
- ``ShedUnderLoad`` (a ``PruneRule`` around another): at each check where other
  work waits for a slot, also prunes this request's lowest-reward running
  branches, down to ``keep``. The scheduler's budget and the request's stop rule
  stay exact: shedding only ends branches early, as pruning does.

``sart.policies.recipes.sart_adaptive`` combines them with SART's rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import attrs

from sart.errors import int_at_least
from sart.policies.base import AdmitRule, Policy, PruneRule, instance_of
from sart.types import Phase
from sart.views import BranchView, Limits, Load, RequestView


def fair_share(load: Load) -> int:
    """The default curve: the batch slots free now, shared evenly with the requests
    still queued (each of which will want at least one)."""
    return load.free_slots // (load.waiting_requests + 1)


@attrs.frozen
class BranchByLoad(AdmitRule):
    """At admission: ``n = curve(load)`` clamped to ``[floor, ceiling]``, where the
    ceiling is the policy's own ``n`` and ``curve`` defaults to ``fair_share``, or
    ``prm_floor`` while the PRM is behind; the request is served by ``build(n)``
    (default: the policy with ``n`` replaced, for rules that do not depend on it)."""

    floor: int = attrs.field(default=1, validator=int_at_least(1))
    """The fewest branches a request gets, however busy the batch."""
    prm_floor: int = attrs.field(default=1, validator=int_at_least(1))
    """The branches a request gets while the PRM is behind (``Load.prm_waiting``: due
    checks wait for it): more branches would only queue more checks, whose late
    rewards let branches run on unpruned."""
    build: Callable[[int], Policy] | None = None
    """The policy for ``n`` branches, its stop and prune rules sized to ``n``."""
    curve: Callable[[Load], int] = fair_share
    """Branches the load allows, before clamping."""

    def branches(self, ceiling: int, load: Load) -> int:
        """``n`` for ``load`` with this ceiling."""
        if load.prm_waiting > 0:
            return min(self.prm_floor, ceiling)
        return max(min(self.floor, ceiling), min(ceiling, int(self.curve(load))))

    def admit(self, policy: Policy, load: Load) -> Policy:
        """``build(n)`` (or ``policy`` with ``n`` replaced), under ``policy``'s name: results
        are labelled by the family, and show the ``n`` chosen by their branches."""
        n = self.branches(policy.n, load)
        chosen = self.build(n) if self.build is not None else attrs.evolve(policy, n=n)
        return attrs.evolve(chosen, name=policy.name)


@attrs.frozen
class ShedUnderLoad(PruneRule):
    """``inner``'s prunes, within its own budget; and, at a check where other work
    waits for a batch slot, this request's lowest-reward running branches too (unscored
    ones last), down to ``keep`` running, one per slot wanted.

    The slots wanted are the other requests' waiting branches and one per queued
    request. ``inner``'s budget is its ``start(n)`` limit in phase 1 and ``n - 1`` in
    phase 2 (as ``TwoPhasePrune``'s); shed branches count against it, so ``inner``
    never prunes more than alone. Its threshold is ``inner``'s.

    The scheduler's pruning budget is ``n - 1`` throughout, so running branches are
    scored at every check, also once ``inner`` has spent its phase-1 budget (where
    ``inner`` alone would pause scoring until a first completion): more PRM items for
    the same branches when nothing waits."""

    inner: PruneRule = attrs.field(validator=instance_of(PruneRule, "inner"))
    keep: int = attrs.field(default=1, validator=int_at_least(1))
    """Running branches a request keeps, however high the pressure."""

    def validate(self, n: int) -> None:
        self.inner.validate(n)

    def start(self, n: int) -> Limits:
        return Limits(threshold=self.inner.start(n).threshold, max_num_pruned=n - 1)

    def enter_exploit(self, limits: Limits, first: BranchView, n: int) -> Limits:
        inner = self.inner.enter_exploit(limits, first, n)
        return Limits(threshold=inner.threshold, max_num_pruned=n - 1)

    def choose(self, request: RequestView) -> Iterable[int]:
        budget = (
            self.inner.start(request.n).max_num_pruned
            if request.phase is Phase.EXPLORE
            else request.n - 1
        )
        picked = list(self.inner.choose(request))[: max(0, budget - request.num_pruned)]
        wanted = request.others_waiting
        running = len(request.running) - len(picked)
        shed = min(wanted, running - self.keep)
        if shed > 0:
            rest = [b for b in request.running if b.index not in picked]
            rest.sort(key=_shed_order)
            picked += [b.index for b in rest[:shed]]
        return picked

    def fork(self, request: RequestView) -> Mapping[int, int]:
        return self.inner.fork(request)

    @property
    def forks(self) -> bool:
        """As ``inner``: an engine without forking serves it when ``inner`` does not fork."""
        return self.inner.forks


def _shed_order(b: BranchView) -> tuple[float, int, int]:
    # The lowest reward first, unscored ones last; then the fewest tokens (the least
    # work lost), then the highest index.
    reward = b.reward if b.reward is not None and not math.isnan(b.reward) else 2.0
    return (reward, b.num_tokens, -b.index)
