"""The methods and selectors a request may name: registries fixed when the server starts.

A request picks its policy by name (``method``), with the fields that shape it
(``n``, ``m``, ``alpha``, ``beta``, ``interval``) and optionally another
``selector``. Names resolve only to what is registered here: built-ins, or
what the operator's own code registered before the server started
(``sart serve --plugin MODULE``). A request can never make the server import
or run anything.

Built-in methods (the ones ``sart bench`` compares):

==============  ==========================================  ==================
name            policy                                      fields it reads
==============  ==========================================  ==================
vanilla         ``sart.vanilla()``: one branch, no PRM       interval
sc              ``sart.self_consistency(n)``, majority vote  n, interval
sart            ``sart.sart(n, m, alpha, beta)``             n, m, alpha, beta, interval
sart-no-prune   ``sart.sart_without_pruning(n, m)``          n, m, interval
rebase          ``sart.rebase(n)``                           n, interval
deepconf        ``sart.deepconf_online(n)``: confidence      n, interval
sart-conf       ``sart.sart_confidence(n, m, alpha, beta)``  n, m, alpha, beta, interval
==============  ==========================================  ==================

``deepconf`` and ``sart-conf`` score branches with the policy's own
log-probabilities (``sart.policies.confidence``), not the server's PRM: they
run on a server started without one, on any engine that returns logprobs.

Selectors: ``best-reward`` (``BestReward``), ``majority`` (``MajorityVote``),
``weighted`` (``WeightedVote``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from sart.errors import ConfigError, UnknownComponentError, config_check
from sart.policies.base import Policy, Selector
from sart.policies.recipes import (
    deepconf_online,
    rebase,
    sart,
    sart_confidence,
    sart_without_pruning,
    self_consistency,
    vanilla,
)
from sart.policies.select import BestReward, MajorityVote, WeightedVote

#: Policy fields a method may read besides ``n`` and ``interval``.
OPTIONS = ("m", "alpha", "beta")


@attrs.frozen
class Method:
    """A named way to build a request's policy."""

    factory: Callable[..., Policy]
    """Called as ``factory(n=..., interval=..., **options)``; returns the policy."""
    options: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    """Which of ``OPTIONS`` it reads; a request that sets another one is refused."""
    branches: bool = True
    """``False`` for one-branch methods (vanilla): ``n`` must then be 1."""

    @options.validator
    def _check_options(self, _attr: attrs.Attribute, value: frozenset[str]) -> None:
        config_check(value <= set(OPTIONS), "options", sorted(value), f"a subset of {OPTIONS}")


_METHODS: dict[str, Method] = {}

SELECTORS: dict[str, Callable[[], Selector]] = {
    "best-reward": BestReward,
    "majority": MajorityVote,
    "weighted": WeightedVote,
}
"""Selector names a request may give in ``selector``."""


def register_method(
    name: str,
    factory: Callable[..., Policy],
    *,
    options: Iterable[str] = (),
    branches: bool = True,
) -> None:
    """Make ``name`` a method requests may ask for.

    ``factory(n=..., interval=..., **options)`` builds the policy; ``options``
    names which of ``m``, ``alpha``, ``beta`` it accepts (a request setting
    another one gets a 400). Register before the server starts (from a module
    given to ``sart serve --plugin``); a name registered twice is replaced."""
    config_check(isinstance(name, str) and name != "", "name", name, "a non-empty str")
    _METHODS[name] = Method(factory, frozenset(options), branches)


def method_names() -> list[str]:
    return sorted(_METHODS)


def get_method(name: str) -> Method:
    try:
        return _METHODS[name]
    except KeyError:
        raise UnknownComponentError(f"method={name!r} must be one of {method_names()}") from None


register_method("vanilla", lambda n, interval: vanilla(interval=interval), branches=False)
register_method("sc", lambda n, interval: self_consistency(n, interval=interval))
register_method(
    "sart",
    lambda n, interval, m=None, alpha=0.5, beta=None: sart(
        n, m=m, alpha=alpha, beta=beta, interval=interval
    ),
    options=("m", "alpha", "beta"),
)
register_method(
    "sart-no-prune",
    lambda n, interval, m=None: sart_without_pruning(n, m=m, interval=interval),
    options=("m",),
)
register_method("rebase", lambda n, interval: rebase(n, interval=interval))
register_method("deepconf", lambda n, interval: deepconf_online(n, interval=interval))
register_method(
    "sart-conf",
    lambda n, interval, m=None, alpha=0.5, beta=None: sart_confidence(
        n, m=m, alpha=alpha, beta=beta, interval=interval
    ),
    options=("m", "alpha", "beta"),
)


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
    fields: PolicyFields, *, method: str, n: int, max_n: int, interval: int
) -> tuple[str, Policy]:
    """The method's name and the policy ``fields`` ask for, the server's defaults
    (``method``, ``n``, ``interval``) filling what they leave out; ``max_n`` is the
    server's limit on branches. Raises ``ConfigError`` naming the field at fault."""
    name = fields.method if fields.method is not None else method
    chosen = get_method(name)
    if chosen.branches:
        branches = fields.n if fields.n is not None else n
    else:
        branches = 1
        if fields.n not in (None, 1):
            raise ConfigError(f"n={fields.n!r} must be 1: method {name!r} samples one branch")
    config_check(branches <= max_n, "n", branches, f"<= {max_n} (the server's --max-n)")
    options = {}
    for option in OPTIONS:
        value = getattr(fields, option)
        if value is None:
            continue
        if option not in chosen.options:
            reads = ", ".join(
                ["n", *sorted(chosen.options), "interval"] if chosen.branches else ["interval"]
            )
            raise ConfigError(
                f"{option}={value!r} does not apply to method {name!r}, which reads {reads}"
            )
        options[option] = value
    every = fields.interval if fields.interval is not None else interval
    policy = chosen.factory(n=branches, interval=every, **options)
    if not isinstance(policy, Policy):
        raise TypeError(f"method {name!r} built {policy!r}, not a sart.Policy")
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
    return name, policy
