"""The methods every command takes by name: one registry for ``sart bench``, ``sart eval``
and ``sart serve``.

A method is a named recipe: ``factory(n=..., interval=..., **options)`` builds a
request's ``Policy``. Each carries what the commands need to know about it: its
labels (tables, plots), where its rewards come from (``Rewards``: a PRM, the
policy's own log-probabilities, or none), which of the options ``m``, ``alpha``,
``beta`` it reads, whether it samples several branches, and, for an alias such as
``sart-blocking``, the scoring it always runs with.

Register your own with ``register_method`` before a command runs (``--plugin
MODULE`` imports a module that does, for every command):

    import sart
    from sart.methods import register_method

    register_method("wide-sc", lambda n, interval: sart.self_consistency(2 * n, interval=interval),
                    label="Self-Consistency at 2N", rewards="none")

Built-ins:

==============  ==========================================  ==========  ======================
name            policy                                      rewards     options
==============  ==========================================  ==========  ======================
vanilla         ``sart.vanilla()``: one branch               none        --
sc              ``sart.self_consistency(n)``, majority vote  none        --
rebase          ``sart.rebase(n)``                           prm         --
sart-no-prune   ``sart.sart_without_pruning(n, m)``          prm         m
sart            ``sart.sart(n, m, alpha, beta)``             prm         m, alpha, beta
sart-adaptive   ``sart.sart_adaptive(n, m, alpha, beta)``    prm         m, alpha, beta
sart-blocking   ``sart`` with blocking checks (an alias)     prm         m, alpha, beta
deepconf        ``sart.deepconf_online(n)``                  confidence  --
sart-conf       ``sart.sart_confidence(n, m, alpha, beta)``  confidence  m, alpha, beta
sart-rebranch   ``sart.sart_rebranch(n, m, alpha, beta)``    prm         m, alpha, beta
particle        ``sart.particle_filter(n)``                  prm         --
==============  ==========================================  ==========  ======================

This module is pure: it builds policies, it never loads or runs anything.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from sart.errors import ConfigError, UnknownComponentError, config_check, enum_converter
from sart.policies import recipes
from sart.policies.base import Policy
from sart.policies.equivalence import Equivalence
from sart.types import Scoring

OPTIONS = ("m", "alpha", "beta")
"""Policy fields a method may read besides ``n`` and ``interval``."""


def grouped_by(policy: Policy, equivalence: Equivalence) -> Policy:
    """``policy`` with its votes (``MajorityVote``, ``WeightedVote``) and agreement stop
    (``Agreement``) grouping answers under ``equivalence``; its other parts as they are."""
    return attrs.evolve(
        policy,
        select=_grouping(policy.select, equivalence),
        stop=_grouping(policy.stop, equivalence),
    )


def _grouping(part: Any, equivalence: Equivalence) -> Any:
    """``part`` grouping answers under ``equivalence``, if it groups answers."""
    if attrs.has(type(part)) and "equivalence" in attrs.fields_dict(type(part)):
        return attrs.evolve(part, equivalence=equivalence)
    return part


class Rewards(enum.Enum):
    """Where a method's branch rewards come from."""

    PRM = "prm"
    """The process reward model the command loads."""
    CONFIDENCE = "confidence"
    """The policy's own log-probabilities (``Policy.reward``); no PRM."""
    NONE = "none"
    """No rewards: the method never scores a branch."""


def _options(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _to_rewards(value: object) -> Rewards:
    return enum_converter(Rewards, "rewards")(value)


def _optional_scoring(value: Scoring | str | None) -> Scoring | None:
    return None if value is None else enum_converter(Scoring, "scoring")(value)


@attrs.frozen
class Method:
    """A named way to build a request's policy."""

    name: str
    factory: Callable[..., Policy]
    """Called as ``factory(n=..., interval=..., **options)``; returns the policy."""
    label: str
    """For legends and JSON (``"Self-Consistency"``)."""
    short_label: str
    """For table columns (``"SC"``)."""
    rewards: Rewards = attrs.field(default=Rewards.PRM, converter=_to_rewards)
    options: frozenset[str] = attrs.field(default=frozenset(), converter=_options)
    """Which of ``OPTIONS`` it reads; setting another one is refused."""
    branches: bool = True
    """``False`` for one-branch methods (vanilla): ``n`` is then always 1."""
    scoring: Scoring | None = attrs.field(default=None, converter=_optional_scoring)
    """The scoring it always runs with, whatever the run's (``None``: the run's)."""

    @options.validator
    def _check_options(self, _attr: attrs.Attribute, value: frozenset[str]) -> None:
        config_check(value <= set(OPTIONS), "options", sorted(value), f"a subset of {OPTIONS}")

    @property
    def needs_prm(self) -> bool:
        return self.rewards is Rewards.PRM

    def policy(self, n: int, interval: int, **options: Any) -> Policy:
        """The policy for ``n`` branches checked every ``interval`` tokens (``n`` is
        ignored by a one-branch method); ``options`` must be ones it reads."""
        unknown = sorted(set(options) - self.options)
        if unknown:
            reads = ", ".join(
                ["n", *sorted(self.options), "interval"] if self.branches else ["interval"]
            )
            raise ConfigError(
                f"{unknown[0]}={options[unknown[0]]!r} does not apply to method "
                f"{self.name!r}, which reads {reads}"
            )
        policy = self.factory(n=n if self.branches else 1, interval=interval, **options)
        if not isinstance(policy, Policy):
            raise TypeError(f"method {self.name!r} built {policy!r}, not a sart.Policy")
        return policy

    def scoring_in(self, scoring: Scoring) -> Scoring:
        """How this method's checks are scored in a run whose scoring is ``scoring``."""
        return scoring if self.scoring is None else self.scoring


_METHODS: dict[str, Method] = {}


def register_method(
    name: str,
    factory: Callable[..., Policy],
    *,
    label: str | None = None,
    short_label: str | None = None,
    rewards: Rewards | str = Rewards.PRM,
    options: Iterable[str] = (),
    branches: bool = True,
    scoring: Scoring | str | None = None,
) -> Method:
    """Make ``name`` a method every command takes (``--methods``, a request's
    ``method``).

    ``factory(n=..., interval=..., **options)`` builds the policy; ``options`` names
    which of ``m``, ``alpha``, ``beta`` it accepts; ``rewards`` says what scores its
    branches (``"prm"``, the default, ``"confidence"`` or ``"none"``): a command
    refuses a PRM method when it has no PRM. ``scoring`` fixes its scoring (an
    alias such as ``sart-blocking``). A name registered twice is replaced."""
    config_check(isinstance(name, str) and name != "", "name", name, "a non-empty str")
    method = Method(
        name,
        factory,
        label or name,
        short_label or label or name,
        rewards,
        frozenset(options),
        branches,
        scoring,
    )
    _METHODS[name] = method
    return method


def method_names() -> list[str]:
    """Every registered method's name, sorted."""
    return sorted(_METHODS)


def get_method(name: str) -> Method:
    """The method registered as ``name`` (``UnknownComponentError`` naming the choices)."""
    try:
        return _METHODS[name]
    except KeyError:
        raise UnknownComponentError(f"method={name!r} must be one of {method_names()}") from None


def check_methods(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` without repeats, each registered (``ConfigError`` naming the first that
    is not)."""
    chosen = tuple(dict.fromkeys(names))
    for name in chosen:
        if name not in _METHODS:
            raise ConfigError(f"methods={name!r} must be one of {method_names()}")
    return chosen


def _two_phase(recipe: Callable[..., Policy]) -> Callable[..., Policy]:
    """A method factory for a recipe with SART's options (``m``, ``alpha``, ``beta``)."""

    def build(
        n: int, interval: int, m: int | None = None, alpha: float = 0.5, beta: int | None = None
    ) -> Policy:
        return recipe(n, m=m, alpha=alpha, beta=beta, interval=interval)

    return build


_sart = _two_phase(recipes.sart)


register_method(
    "vanilla",
    lambda n, interval: recipes.vanilla(interval=interval),
    label="Vanilla",
    rewards=Rewards.NONE,
    branches=False,
)
register_method(
    "sc",
    lambda n, interval: recipes.self_consistency(n, interval=interval),
    label="Self-Consistency",
    short_label="SC",
    rewards=Rewards.NONE,
)
register_method("rebase", lambda n, interval: recipes.rebase(n, interval=interval), label="Rebase")
register_method(
    "sart-no-prune",
    lambda n, interval, m=None: recipes.sart_without_pruning(n, m=m, interval=interval),
    label="SART (w/o pruning)",
    short_label="SART-noprune",
    options=("m",),
)
register_method("sart", _sart, label="SART", options=OPTIONS)
register_method(
    "sart-adaptive",
    _two_phase(recipes.sart_adaptive),
    label="SART (adaptive N, ceiling N)",
    short_label="SART-adaptive",
    options=OPTIONS,
)
# Blocking vs overlapped is a scoring option (``--scoring``); this alias keeps SART
# with blocking checks nameable beside ``sart``, to compare the two in one run.
register_method(
    "sart-blocking",
    _sart,
    label="SART (blocking checks)",
    short_label="SART-blocking",
    options=OPTIONS,
    scoring=Scoring.BLOCKING,
)
register_method(
    "deepconf",
    lambda n, interval: recipes.deepconf_online(n, interval=interval),
    label="DeepConf-online (confidence, no PRM)",
    short_label="DeepConf",
    rewards=Rewards.CONFIDENCE,
)
register_method(
    "sart-conf",
    _two_phase(recipes.sart_confidence),
    label="SART on confidence (no PRM)",
    short_label="SART-conf",
    rewards=Rewards.CONFIDENCE,
    options=OPTIONS,
)
register_method(
    "sart-rebranch",
    _two_phase(recipes.sart_rebranch),
    label="SART with re-branching",
    short_label="SART-rebranch",
    options=OPTIONS,
)
register_method(
    "particle",
    lambda n, interval: recipes.particle_filter(n, interval=interval),
    label="Particle filtering",
    short_label="Particle",
)

__all__ = [
    "OPTIONS",
    "Method",
    "Rewards",
    "check_methods",
    "get_method",
    "method_names",
    "register_method",
]
