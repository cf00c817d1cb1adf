"""The methods and selectors a request may name: fixed when the server starts.

A request picks its policy by name (``method``), with the fields that shape it
(``n``, ``m``, ``alpha``, ``beta``, ``interval``) and optionally another
``selector``. Methods are those of the one registry every command shares
(``sart.methods``): built-ins, or what the operator's own code registered
before the server started (``sart serve --plugin MODULE``). A request can never
make the server import or run anything.

``deepconf`` and ``sart-conf`` score branches with the policy's own
log-probabilities (``sart.confidence.scorer``), not the server's PRM: they
run on a server started without one, on any engine that returns logprobs. An
alias that fixes its scoring (``sart-blocking``) runs only on a server started
with that scoring.

Selectors: ``best-reward`` (``BestReward``), ``majority`` (``MajorityVote``),
``weighted`` (``WeightedVote``).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from sart.errors import ConfigError, config_check
from sart.methods import OPTIONS, Method, get_method, grouped_by, method_names, register_method
from sart.policies.base import Policy, Selector
from sart.policies.equivalence import Equivalence
from sart.policies.select import BestReward, MajorityVote, WeightedVote
from sart.types import Scoring

SELECTORS: dict[str, Callable[[], Selector]] = {
    "best-reward": BestReward,
    "majority": MajorityVote,
    "weighted": WeightedVote,
}
"""Selector names a request may give in ``selector``."""


@attrs.frozen
class PolicyFields:
    """A request's policy fields as sent; ``None`` means "not given" (the server's
    default applies)."""

    method: str | None = None
    n: int | None = None
    m: int | None = None
    alpha: float | None = None
    beta: int | None = None
    interval: int | None = None
    selector: str | None = None


def build_policy(
    fields: PolicyFields,
    *,
    method: str,
    n: int,
    max_n: int,
    interval: int,
    scoring: Scoring | None = None,
    equivalence: Equivalence | None = None,
) -> tuple[str, Policy]:
    """The method's name and the policy ``fields`` ask for, the server's defaults
    (``method``, ``n``, ``interval``) filling what they leave out; ``max_n`` is the
    server's limit on branches, ``scoring`` its scoring (a method that fixes another
    is refused), ``equivalence`` how its votes group answers (``None``: the
    method's own). Raises ``ConfigError`` naming the field at fault."""
    name = fields.method if fields.method is not None else method
    chosen = get_method(name)
    if chosen.branches:
        branches = fields.n if fields.n is not None else n
    else:
        branches = 1
        if fields.n not in (None, 1):
            raise ConfigError(f"n={fields.n!r} must be 1: method {name!r} samples one branch")
    config_check(branches <= max_n, "n", branches, f"<= {max_n} (the server's --max-n)")
    if scoring is not None and chosen.scoring not in (None, scoring):
        raise ConfigError(
            f"method={name!r} runs with {chosen.scoring.value} checks, and this server "
            f"scores {scoring.value} (start it with --scoring {chosen.scoring.value})"
        )
    options = {o: getattr(fields, o) for o in OPTIONS if getattr(fields, o) is not None}
    every = fields.interval if fields.interval is not None else interval
    policy = chosen.policy(branches, every, **options)
    if fields.selector is not None:
        if fields.selector not in SELECTORS:
            raise ConfigError(f"selector={fields.selector!r} must be one of {sorted(SELECTORS)}")
        if policy.n == 1:
            raise ConfigError(
                f"selector={fields.selector!r} does not apply: method {name!r} samples one branch"
            )
        policy = attrs.evolve(
            policy,
            select=SELECTORS[fields.selector](),
            name=f"{policy.name},select={fields.selector}",
        )
    if equivalence is not None:
        policy = grouped_by(policy, equivalence)
    return name, policy


__all__ = [
    "SELECTORS",
    "Method",
    "PolicyFields",
    "build_policy",
    "get_method",
    "method_names",
    "register_method",
]
