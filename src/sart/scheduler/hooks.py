"""Calling a request's policy hooks safely: whatever a hook raises or returns that
the scheduler cannot use becomes a ``PolicyFailure``, which fails that request
alone (its branches aborted, a reason naming the hook), never the run."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs

from sart.policies.base import AdmitRule, PauseRule, Policy, PruneRule
from sart.state import BranchState, RequestState
from sart.types import BranchStatus
from sart.views import Limits, Load, RequestView

T = TypeVar("T")


class PolicyFailure(Exception):
    """A policy hook raised or returned something unusable; fails one request."""


def call(fn: Callable[..., T], *args: object, name: str | None = None) -> T:
    """Run a policy hook; anything it raises fails only its request."""
    try:
        return fn(*args)
    except Exception as exc:
        name = name or getattr(fn, "__qualname__", repr(fn))
        raise PolicyFailure(f"policy hook {name} raised {exc!r}") from exc


def whole(value: object) -> int | None:
    """``value`` as an ``int`` where it is a whole number (numpy's integers too, as a
    rule computing with arrays returns them), ``None`` otherwise: a bool is not one
    (``True`` would pass as branch 1)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def checked_limits(value: object, hook: str) -> Limits:
    """A hook's ``Limits``, checked, so a bad value fails its request, not the run."""
    if isinstance(value, Limits):
        budget = whole(value.max_num_pruned)
        threshold = value.threshold
        number = isinstance(threshold, (int, float)) and not math.isnan(threshold)
        if budget is not None and budget >= 0 and (threshold is None or number):
            return attrs.evolve(value, max_num_pruned=budget)
    raise PolicyFailure(f"prune rule's {hook} returned {value!r}, not valid Limits")


def admitted_policy(policy: Policy, load: Load) -> Policy:
    """The policy ``policy.admit`` settles on for ``load``, checked: a ``Policy`` with
    one to ``policy.n`` branches, without an admission rule of its own (it is
    settled); ``PolicyFailure`` otherwise."""
    rule = policy.admit
    chosen = call(rule.admit, policy, load, name=f"{type(rule).__name__}.admit")
    if not isinstance(chosen, Policy) or not 1 <= chosen.n <= policy.n:
        raise PolicyFailure(
            f"admission rule {type(rule).__name__} returned {chosen!r}: a Policy with 1 to "
            f"{policy.n} branches was expected"
        )
    beyond = needs_beyond(policy, chosen)
    if beyond:
        raise PolicyFailure(
            f"admission rule {type(rule).__name__} settled on policy {chosen.name!r}, which "
            f"needs {beyond} that the submitted {policy.name!r} does not: the driver set up "
            "rewards, sampling and the engine's checks for the submitted policy"
        )
    return attrs.evolve(chosen, admit=AdmitRule()) if chosen.admit.active else chosen


def needs_beyond(submitted: Policy, settled: Policy) -> str:
    """What ``settled`` needs that ``submitted`` does not ('' if nothing). The driver
    routes rewards, asks for log-probabilities and checks the engine and PRM from the
    submitted policy before it arrives, so a settled policy may narrow it (fewer
    branches, less scoring) but not need more: that would reach a PRM the driver may
    not have, or an engine that cannot fork."""
    if settled.reward != submitted.reward:
        return f"another reward source ({settled.reward!r})"
    if settled.scores_running and not submitted.scores_running:
        return "rewards for its running branches"
    if settled.scores_completed and not submitted.scores_completed:
        return "rewards for its completed branches"
    if settled.forks and not submitted.forks:
        return "forks"
    return ""


def running_choices(req: RequestState, chosen: Sequence[object], rule: str) -> list[BranchState]:
    """The branches a rule named, checked: each an index of a running branch, once
    (``PolicyFailure`` naming the ``rule`` otherwise)."""
    picked: list[BranchState] = []
    for choice in chosen:
        index = whole(choice)
        if index is None or not 0 <= index < len(req.branches):
            raise PolicyFailure(f"{rule} rule chose {choice!r}, not a branch index")
        branch = req.branches[index]
        if branch in picked:
            raise PolicyFailure(f"{rule} rule chose branch {index} twice")
        if branch.status is not BranchStatus.RUNNING:
            raise PolicyFailure(f"{rule} rule chose branch {index}, which is not running")
        picked.append(branch)
    return picked


def choose_running(
    req: RequestState, view: RequestView, rule: PruneRule | PauseRule, what: str
) -> list[BranchState]:
    """The running branches ``rule.choose`` names from ``view`` of ``req``, checked (a
    prune or a pause rule: ``what`` says which, in the failure's reason)."""
    choose = rule.choose
    chosen = call(lambda v: list(choose(v)), view, name=f"{type(rule).__name__}.choose")
    return running_choices(req, chosen, what)
