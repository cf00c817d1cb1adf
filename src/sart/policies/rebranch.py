"""Re-branching: re-spend a request's free seats on forks of its best live branches.

Pruning frees a branch's slot; SART alone leaves it empty, tree search (REBASE,
particle filtering) re-spends it on forks of high-reward prefixes, which is where
its accuracy comes from. ``Rebranch`` is a ``RebranchRule`` that does the latter
inside any policy -- beside ``TwoPhasePrune``, ``FirstM``, ``BestReward`` or a
confidence reward source -- and decides:

- **which parents**: running branches with a reward, not past ``until`` of
  ``max_tokens`` (a fork late in a branch is nearly a copy of it), shared out by
  ``parents``: ``"softmax"`` (REBASE's ``softmax(reward / temperature)``, largest
  remainders), ``"top"`` (the best first, one child each, round robin) or
  ``"systematic"`` (particle filtering's systematic resampling by the same
  weights, seeded by the request's seed and its branch count);
- **how many**: the seats pruning freed (``n`` less the live branches less the
  completed ones), or with ``refill_completed`` also the completed branches'
  seats, so ``n`` branches keep running until the stop rule is met;
- **until when**: no forks once ``stop_after`` branches have completed, or once the
  request has generated ``token_budget`` tokens;
- **under what load**: with ``when_idle`` (the default), only while no other work
  waits for a batch slot, the KV cache is below ``kv_limit`` of its capacity and,
  with a ``row_budget``, the running branches add at most that share to a decode
  step's fixed cost (the ``Load`` that ``sart-adaptive`` reads). At saturation it
  forks nothing: the policy is its plain self again, and freed slots go to waiting
  requests.

The scheduler caps the forks at the batch slots free now and never lets a request
hold more than ``n`` live branches. Pure: it reads a ``RequestView`` and returns
plain data.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import attrs

from sart.errors import config_check, number_above
from sart.policies.base import RebranchRule
from sart.views import BranchView, RequestView

PARENTS = ("softmax", "top", "systematic")
"""How a rule shares forks among candidate parents."""


def parent_weights(parents: Sequence[BranchView], temperature: float | None) -> list[float]:
    """Each parent's weight: ``softmax(reward / temperature)``, or the reward itself
    (``temperature=None``: a particle filter's likelihood). All zero: equal weights."""
    rewards = [float(b.reward) for b in parents]  # type: ignore[arg-type]
    if temperature is None:
        weights = [max(0.0, r) for r in rewards]
    else:
        top = max(rewards)
        weights = [math.exp((r - top) / temperature) for r in rewards]
    if sum(weights) <= 0.0:
        return [1.0] * len(parents)
    return weights


def largest_remainder(
    parents: Sequence[BranchView], weights: Sequence[float], k: int
) -> dict[int, int]:
    """``k`` shared in proportion to ``weights``, largest remainders first (ties: the
    higher reward, then the lower index)."""
    total = sum(weights)
    quotas = [k * w / total for w in weights]
    shares = {b.index: math.floor(q) for b, q in zip(parents, quotas)}
    order = sorted(
        zip(parents, quotas),
        key=lambda p: (-(p[1] - math.floor(p[1])), -(p[0].reward or 0.0), p[0].index),
    )
    for parent, _ in order[: k - sum(shares.values())]:
        shares[parent.index] += 1
    return shares


def systematic(
    parents: Sequence[BranchView], weights: Sequence[float], k: int, u: float
) -> dict[int, int]:
    """``k`` draws by systematic resampling (one uniform ``u`` in [0, 1)): parent ``i``
    gets between ``floor(k w_i)`` and ``ceil(k w_i)``, its expectation exactly."""
    total = sum(weights)
    shares = {b.index: 0 for b in parents}
    cumulative = 0.0
    at = 0
    for b, w in zip(parents, weights):
        cumulative += k * w / total
        # Points u, u + 1, ..., u + k - 1 below the cumulative sum fall in this parent.
        while at < k and at + u < cumulative:
            shares[b.index] += 1
            at += 1
    shares[parents[-1].index] += k - at  # rounding at the end of the sum
    return shares


def top_first(parents: Sequence[BranchView], k: int) -> dict[int, int]:
    """One child each to the best-rewarded parents, round robin while ``k`` lasts."""
    ranked = sorted(parents, key=lambda b: (-(b.reward or 0.0), b.index))
    shares = {b.index: 0 for b in ranked}
    for i in range(k):
        shares[ranked[i % len(ranked)].index] += 1
    return shares


def draw_uniform(request: RequestView) -> float:
    """The request's uniform draw at this check: seeded by its seed and branch count
    (one more fork, one new draw), the same every time the view is the same."""
    return random.Random(f"{request.seed}/{len(request.branches)}").random()


def _check_parents(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    config_check(value in PARENTS, "parents", value, f"one of {PARENTS}")


def _check_temperature(_inst: object, _attr: attrs.Attribute, value: float | None) -> None:
    config_check(
        value is None or (isinstance(value, (int, float)) and value > 0),
        "temperature",
        value,
        "> 0 (or None: weights are the rewards)",
    )


def _check_share(_inst: object, attr: attrs.Attribute, value: float) -> None:
    config_check(
        isinstance(value, (int, float)) and 0.0 < value <= 1.0, attr.name, value, "in (0, 1]"
    )


def _check_optional_count(_inst: object, attr: attrs.Attribute, value: int | None) -> None:
    config_check(
        value is None or (isinstance(value, int) and value >= 1), attr.name, value, ">= 1 or None"
    )


@attrs.frozen
class Rebranch(RebranchRule):
    """Forks of the best live branches in the seats a request has free (module docstring)."""

    parents: str = attrs.field(default="softmax", validator=_check_parents)
    """How forks are shared among parents: ``"softmax"``, ``"top"`` or ``"systematic"``."""
    temperature: float | None = attrs.field(default=0.2, validator=_check_temperature)
    """Softmax temperature over rewards in [0, 1] (``None``: weights are the rewards)."""
    until: float = attrs.field(default=0.5, validator=_check_share)
    """No branch past this share of ``max_tokens`` is a parent."""
    refill_completed: bool = False
    """Refill completed branches' seats too (else only the seats pruning freed)."""
    stop_after: int | None = attrs.field(default=None, validator=_check_optional_count)
    """No forks once this many branches have completed (``None``: until the stop rule)."""
    token_budget: int | None = attrs.field(default=None, validator=_check_optional_count)
    """No forks once the request's branches have generated this many tokens."""
    when_idle: bool = True
    """Fork only while no other work waits for a slot and the KV cache has room."""
    kv_limit: float = attrs.field(default=0.9, validator=_check_share)
    """``when_idle``: no forks while the KV cache is at least this full."""
    row_budget: float | None = attrs.field(default=None, validator=number_above(0, optional=True))
    """``when_idle``: no forks while the running branches add more than this share
    to a decode step's fixed cost (``Load.rows_cost``; ``None``: rows are free)."""

    def may_fork(self, request: RequestView) -> bool:
        """Whether this check may fork at all: its limits and, ``when_idle``, the load."""
        if self.stop_after is not None and request.num_completed >= self.stop_after:
            return False
        if self.token_budget is not None and request.generated_tokens >= self.token_budget:
            return False
        if self.when_idle and request.load is not None:
            use = request.load.kv_use
            if request.others_waiting > 0 or (use is not None and use >= self.kv_limit):
                return False
            if not request.load.rows_within(self.row_budget):
                return False
        return True

    def candidates(self, request: RequestView) -> list[BranchView]:
        """Running branches that may be parents: rewarded, not past ``until``."""
        cap = None if request.max_tokens is None else self.until * request.max_tokens
        return [
            b
            for b in request.running
            if b.reward is not None
            and not math.isnan(b.reward)
            and (cap is None or b.num_tokens <= cap)
        ]

    def seats(self, request: RequestView, room: int) -> int:
        """Forks this check may start: ``room``, less the completed branches' seats
        unless ``refill_completed``."""
        if self.refill_completed:
            return room
        return max(0, min(room, request.n - len(request.live) - request.num_completed))

    def fork(self, request: RequestView, room: int) -> Mapping[int, int]:
        k = self.seats(request, room)
        if k == 0 or not self.may_fork(request):
            return {}
        parents = self.candidates(request)
        if not parents:
            return {}
        if self.parents == "top":
            shares = top_first(parents, k)
        else:
            weights = parent_weights(parents, self.temperature)
            if self.parents == "softmax":
                shares = largest_remainder(parents, weights, k)
            else:
                shares = systematic(parents, weights, k, draw_uniform(request))
        return {index: count for index, count in shares.items() if count}
