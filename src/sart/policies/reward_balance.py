"""Rebase (REward BAlanced SEarch, Wu et al. 2024) mapped onto SART's scheduler.

Rebase grows a tree of partial solutions under a width budget of ``N``
leaves: each round the PRM scores every leaf, and the budget left
(``N`` minus completed solutions) is shared among the leaves in proportion to
``softmax(reward / temperature)``; a leaf that gets ``k`` expands into ``k``
children, one that gets 0 is dropped. The answer is the reward-weighted
majority vote over completed solutions.

Mapping onto the step/chunk model:

- a tree *step* is one check interval of ``T`` tokens: the scheduler scores
  and acts only at checks, so that is where the tree can branch;
- the leaves are the request's running branches; the ``n`` root branches are
  admitted like any request's (sharing the prompt's KV);
- at each check the running leaves' count ``W`` is re-shared: 0 -> the leaf
  is pruned (its KV freed at once), ``k >= 2`` -> it is forked into ``k - 1``
  new branches that continue from its tokens with their own seeds (copy of
  its KV; on vLLM/SGLang a new request over prompt + partial, served from the
  prefix cache). The shares sum to ``W``, so the forks exactly fill the slots
  the prunes freed: the branch budget ``B`` is never exceeded and no other
  request loses a slot. A completed leaf is not replaced, so the budget
  shrinks with every solution, as in Rebase;
- leaves are re-shared only when every one of them has been scored this check.

``Reshare`` is the same re-sharing made load-aware, for SART that prunes *and*
re-branches (``sart.sart_rebranch``): while no other work waits for a batch slot
and the KV cache has room it re-shares as Rebase does; while others wait it
shrinks as its ``inner`` rule (SART's two phases) would, so the slots pruning
frees go to the waiting requests, but re-shares the fewer slots it keeps among
the best prefixes; with the KV cache full it prunes as ``inner`` and forks nothing.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence

import attrs

from sart.errors import config_check, number_above
from sart.policies.base import PruneRule, instance_of
from sart.types import Phase
from sart.views import BranchView, Limits, RequestView


def allocate(
    leaves: Sequence[BranchView], temperature: float, slots: int | None = None
) -> dict[int, int]:
    """Share ``slots`` (default ``len(leaves)``) slots by ``softmax(reward /
    temperature)``, largest remainders first (ties: higher reward, then lower
    index). ``{}`` if a leaf has no reward yet."""
    slots = len(leaves) if slots is None else slots
    rewards: dict[int, float] = {}
    for b in leaves:
        if b.reward is None:
            return {}
        rewards[b.index] = b.reward
    top = max(rewards.values())
    weights = [math.exp((rewards[b.index] - top) / temperature) for b in leaves]
    total = sum(weights)
    quotas = [slots * w / total for w in weights]
    shares = {b.index: math.floor(q) for b, q in zip(leaves, quotas)}
    left = slots - sum(shares.values())
    order = sorted(
        zip(leaves, quotas),
        key=lambda p: (-(p[1] - math.floor(p[1])), -rewards[p[0].index], p[0].index),
    )
    for leaf, _ in order[:left]:
        shares[leaf.index] += 1
    return shares


def _check_temperature(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    config_check(value > 0, "temperature", value, "> 0")


@attrs.frozen
class RewardBalance(PruneRule):
    """Rebase's reward-balanced re-sharing of the running leaves (module docstring)."""

    temperature: float = attrs.field(default=0.2, validator=_check_temperature)
    """Softmax temperature over rewards in [0, 1]: lower concentrates on the best leaves."""

    def start(self, n: int) -> Limits:
        # Prunes are replaced by forks, so the paper's cap on prunes does not apply;
        # the scheduler still never prunes every branch.
        return Limits(threshold=None, max_num_pruned=sys.maxsize)

    def choose(self, request: RequestView) -> Iterable[int]:
        shares = allocate(request.running, self.temperature)
        dropped = [b for b in request.running if shares.get(b.index, 1) == 0]
        return [b.index for b in sorted(dropped, key=lambda b: (b.reward, b.index))]

    def fork(self, request: RequestView) -> Mapping[int, int]:
        shares = allocate(request.running, self.temperature)
        return {index: k - 1 for index, k in shares.items() if k >= 2}


def _check_share(_inst: object, attr: attrs.Attribute, value: float) -> None:
    ok = isinstance(value, (int, float)) and 0.0 < value <= 1.0
    config_check(ok, attr.name, value, "in (0, 1]")


BUSY = ("reshare", "replace", "prune")
"""What ``Reshare`` does while other work waits: re-share the slots it keeps at every
check, only at checks where ``inner`` prunes, or never (prune only)."""


def _check_busy(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    config_check(value in BUSY, "busy", value, f"one of {BUSY}")


@attrs.frozen
class Reshare(PruneRule):
    """Rebase's re-sharing while the server has room, ``inner``'s shrink under load.

    Idle (no other request or branch waits for a batch slot, and the KV cache is
    below ``kv_limit`` of its capacity): at each check the running branches are
    re-shared by ``softmax(reward / temperature)`` as ``RewardBalance`` does, the
    ones whose share is 0 pruned and the others forked into the slots freed.

    Busy: ``inner`` picks its prunes within its own budget (its ``start(n)`` limit
    in phase 1, ``n - 1`` in phase 2, counting every prune of the request,
    re-sharing's too), so the request shrinks by as many branches as ``inner``
    alone would shrink it. With ``busy="reshare"`` (the default) the slots it keeps
    are re-shared among the running branches by the same softmax -- SART's shrink,
    Rebase's choice of survivors -- unless the KV cache is at ``kv_limit``, where a
    fork's own KV has no room; ``busy="replace"`` re-shares only at the checks where
    ``inner`` prunes; with ``busy="prune"``, and whenever the KV cache is full,
    ``inner``'s prunes stand and nothing is forked. The threshold is ``inner``'s
    throughout.

    Compute is room too: with a ``row_budget``, while the batch's running branches
    add more than ``row_budget`` times a decode step's fixed cost (the scheduler's
    fit of step time against rows, ``Load.rows_cost``), every branch a request
    keeps slows every step of every request, so the request is busy: it shrinks as
    ``inner`` would, and ``busy`` says what it does with the slots it keeps. On a
    GPU serving a large model a row adds a few percent of a step and the budget
    seldom binds; on a CPU each row adds its own compute.
    """

    inner: PruneRule = attrs.field(validator=instance_of(PruneRule, "inner"))
    temperature: float = attrs.field(default=0.2, validator=_check_temperature)
    kv_limit: float = attrs.field(default=0.9, validator=_check_share)
    """Idle only while the KV cache is below this share of its capacity."""
    busy: str = attrs.field(default="reshare", validator=_check_busy)
    """Under load: ``"reshare"`` the slots ``inner`` keeps, or ``"prune"`` only."""
    row_budget: float | None = attrs.field(default=None, validator=number_above(0, optional=True))
    """Idle only while the running branches add at most this share to a decode
    step's fixed cost (``Load.rows_cost``; ``None``: rows are taken as free)."""

    def validate(self, n: int) -> None:
        self.inner.validate(n)

    def start(self, n: int) -> Limits:
        # Re-sharing's prunes are replaced by forks: no cap but never all (the
        # scheduler's); ``choose`` keeps ``inner``'s own budget when busy.
        return Limits(threshold=self.inner.start(n).threshold, max_num_pruned=sys.maxsize)

    def enter_exploit(self, limits: Limits, first: BranchView, n: int) -> Limits:
        inner = self.inner.enter_exploit(limits, first, n)
        return Limits(threshold=inner.threshold, max_num_pruned=sys.maxsize)

    def kv_full(self, request: RequestView) -> bool:
        """Whether the KV cache is at ``kv_limit`` of its capacity (no room for forks)."""
        use = None if request.load is None else request.load.kv_use
        return use is not None and use >= self.kv_limit

    def idle(self, request: RequestView) -> bool:
        """Whether the server has room for forks: no other work waits, the KV cache
        is below ``kv_limit``, the rows are within ``row_budget``."""
        if request.others_waiting > 0 or self.kv_full(request):
            return False
        return request.load is None or request.load.rows_within(self.row_budget)

    def shares(self, request: RequestView) -> tuple[list[int], dict[int, int]]:
        """This check's prunes and the slots each running branch keeps (forks: share
        less one). Recomputed by ``fork`` from the same view ``choose`` read."""
        running = request.running
        if self.idle(request):
            shares = allocate(running, self.temperature)
        else:
            budget = (
                self.inner.start(request.n).max_num_pruned
                if request.phase is Phase.EXPLORE
                else request.n - 1
            )
            chosen = list(self.inner.choose(request))[: max(0, budget - request.num_pruned)]
            if self.busy == "prune" or self.kv_full(request):
                return chosen, {}
            if self.busy == "replace" and not chosen:
                return chosen, {}
            shares = allocate(running, self.temperature, len(running) - len(chosen))
            if not shares:  # a branch without a reward yet: ``inner``'s prunes stand
                return chosen, {}
        dropped = [b for b in running if shares.get(b.index, 1) == 0]
        order = sorted(dropped, key=lambda b: (b.reward, b.index))
        return [b.index for b in order], shares

    def choose(self, request: RequestView) -> Iterable[int]:
        return self.shares(request)[0]

    def fork(self, request: RequestView) -> Mapping[int, int]:
        return {index: k - 1 for index, k in self.shares(request)[1].items() if k >= 2}
