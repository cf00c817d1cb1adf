"""The policy parts and the ``Policy`` that holds them.

Five hook classes -- ``StopRule``, ``PruneRule``, ``RebranchRule``, ``PauseRule``,
``AdmitRule`` -- and the ``Selector``; besides them a policy names its reward source
(``reward``) and how an answer is read (``extract``). Each part is a small class
whose hooks have no-op defaults, in the manner of ``trio.abc.Instrument``: override
only what you need. The scheduler notices a prune rule that leaves ``choose`` as
the default and skips scoring for it, and a re-branching rule that leaves ``fork``
as the default and never asks it, so an unused hook costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import ClassVar, Protocol, runtime_checkable

import attrs

from sart.answers import extract_answer
from sart.errors import ConfigError, int_at_least
from sart.messages import ScoreItem
from sart.views import BranchView, Limits, Load, RequestView


@runtime_checkable
class RewardSource(Protocol):
    """What a policy's own reward source provides: the PRM contract's ``score`` (declared
    here because the core knows no adapter; ``sart.prm.base.PRM`` is the same shape)."""

    def score(self, items: Sequence[ScoreItem]) -> Sequence[float]: ...


class StopRule:
    """Decides when a request has enough completed branches to finish early.

    ``should_stop`` is consulted at each check once at least one branch has
    completed (so a finished request always has an answer). The scheduler also
    finishes a request whenever no branch is running or waiting, so the
    default (never stop early) waits for every branch. A rule that sets
    ``needs_answers`` gets the completed branches' answers (``BranchView.answer``,
    by the policy's ``extract``). Completed branches are scored by the PRM for a
    rule that reads ``reward`` (``needs_rewards``, ``True`` unless a rule says it
    does not: the built-in rules read none, and need no PRM); running branches'
    rewards are there where the prune rule has them scored.
    """

    needs_answers: ClassVar[bool] = False
    needs_rewards: ClassVar[bool] = True

    def validate(self, n: int) -> None:
        """Raise ``ConfigError`` if the rule cannot work with ``n`` branches."""

    def should_stop(self, request: RequestView) -> bool:
        return False


class PruneRule:
    """Decides which running branches to prune at a check.

    Hooks, all optional:

    - ``start(n)``: the limits when the request is prefilled (phase explore);
    - ``enter_exploit(limits, first, n)``: new limits when the first branch completes;
    - ``choose(request)``: indices of running branches to prune, most
      prunable first. The scheduler never prunes more than
      ``limits.max_num_pruned - num_pruned`` (nor ever every branch), taking
      the first ones of this list;
    - ``fork(request)``: children to start from running branches, in the
      slots just freed by pruning (tree search such as Rebase).

    Set ``needs_rewards = False`` on a rule that does not read ``reward``, and
    the PRM will not be called for it. Running branches are scored only at
    checks where pruning is possible (the budget is not spent).
    """

    needs_rewards: ClassVar[bool] = True

    def validate(self, n: int) -> None:
        """Raise ``ConfigError`` if the rule cannot work with ``n`` branches."""

    def start(self, n: int) -> Limits:
        return Limits(threshold=None, max_num_pruned=n - 1)

    def enter_exploit(self, limits: Limits, first: BranchView, n: int) -> Limits:
        return limits

    def choose(self, request: RequestView) -> Iterable[int]:
        return ()

    def fork(self, request: RequestView) -> Mapping[int, int]:
        """``{running branch index: number of children}`` to fork at a check, in the
        slots this check's prunes freed (Rebase uses it). Called with the same
        view as ``choose``, and only when ``choose`` pruned something."""
        return {}

    @property
    def active(self) -> bool:
        """Whether this rule prunes anything at all (``choose`` is overridden)."""
        return type(self).choose is not PruneRule.choose

    @property
    def forks(self) -> bool:
        """Whether this rule forks branches (``fork`` is overridden)."""
        return type(self).fork is not PruneRule.fork


class _ByValue:
    """Compared by value, as the other policy parts are (they are attrs classes; the
    bases deriving from this are not, so that a subclass may keep state of its own)."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RebranchRule(_ByValue):
    """Re-spends a request's free seats on forks of its live branches.

    A request has ``n`` seats: each branch started from the prompt takes one, a
    pruned branch gives its seat back, a completed one keeps it. At every check of a
    request that goes on, ``fork(request, room)`` may ask for children of running
    branches: ``{running branch index: children}``, at most ``room`` in all. ``room``
    is the request's free seats counting its completed branches' too (``n`` less its
    live branches), cut to the batch slots free now: a fork starts at once or not at
    all, it never waits for a slot. A rule that refills only pruned seats takes
    ``num_completed`` off ``room`` itself. Children start where their parent is (its
    tokens, text and reward; copy-on-write KV) with seeds of their own, and count
    toward the stop rule only when they complete.

    ``sart.policies.rebranch.Rebranch`` is the stock rule. Running branches are
    scored at every due check of a policy with an active rule (set ``needs_rewards =
    False`` on a rule that picks parents without rewards).
    """

    needs_rewards: ClassVar[bool] = True

    def fork(self, request: RequestView, room: int) -> Mapping[int, int]:
        return {}

    @property
    def active(self) -> bool:
        """Whether this rule may fork at all (``fork`` is overridden)."""
        return type(self).fork is not RebranchRule.fork


@attrs.frozen
class PauseRule:
    """Orders a request's running branches for pausing, most pausable first.

    When more urgent work waits and the budget is full (``SchedulerConfig.pause``),
    the scheduler decides how many branches of this request to pause (never its
    last running one) and takes them in this order. The default: the lowest
    reward first (the branches SART would prune first), unscored ones after the
    scored ones, then the fewest tokens (the least KV to recompute on resume),
    then the highest index.
    """

    def choose(self, request: RequestView) -> Iterable[int]:
        def key(b: BranchView) -> tuple[float, int, int]:
            reward = b.reward if b.reward is not None and b.reward == b.reward else 2.0
            return (reward, b.num_tokens, -b.index)

        return [b.index for b in sorted(request.running, key=key)]


class AdmitRule(_ByValue):
    """Settles a request's policy when it is admitted, from the server's load.

    ``admit(policy, load)`` returns the policy the request is served with: the
    default, ``policy`` itself. A rule may return one with fewer branches (never
    more: the request's branches were counted for the queue at submission) and its
    stop and prune rules sized to them (``sart.policies.adaptive.BranchByLoad``).
    Called once, when the request leaves the queue; the policy it returns has no
    admission rule of its own."""

    def admit(self, policy: Policy, load: Load) -> Policy:
        return policy

    @property
    def active(self) -> bool:
        """Whether this rule may change a policy (``admit`` is overridden)."""
        return type(self).admit is not AdmitRule.admit


class Selector:
    """Picks the final branch among the completed ones.

    ``choose`` gets the completed branches and their extracted answers (same
    order) and returns the index of the chosen branch. The completed branches
    carry PRM rewards unless the selector sets ``needs_rewards = False`` (as
    ``MajorityVote`` does: it needs no PRM).
    """

    needs_rewards: ClassVar[bool] = True

    def choose(self, candidates: Sequence[BranchView], answers: Sequence[str]) -> int:
        raise NotImplementedError


def instance_of(kind: type, field: str) -> Callable[[object, attrs.Attribute, object], None]:
    def check(_inst: object, _attr: attrs.Attribute, value: object) -> None:
        if not isinstance(value, kind):
            raise ConfigError(f"{field}={value!r} must be a {kind.__name__}")

    return check


def _reward_source(_inst: object, _attr: attrs.Attribute, value: object) -> None:
    if value is not None and not callable(getattr(value, "score", None)):
        raise ConfigError(f"reward={value!r} must be a reward source (a PRM: has score(items))")


def _default_stop() -> StopRule:
    from sart.policies.stop import AllDone

    return AllDone()


def _default_prune() -> PruneRule:
    from sart.policies.prune import NoPrune

    return NoPrune()


def _default_select() -> Selector:
    from sart.policies.select import BestReward

    return BestReward()


@attrs.frozen
class Policy:
    """How one request is served: ``n`` branches, a stop rule, a prune rule, a selector."""

    n: int = attrs.field(validator=int_at_least(1))
    """Branches sampled per request."""
    stop: StopRule = attrs.field(factory=_default_stop, validator=instance_of(StopRule, "stop"))
    """When to finish early (default: wait for every branch)."""
    prune: PruneRule = attrs.field(
        factory=_default_prune, validator=instance_of(PruneRule, "prune")
    )
    """Which running branches to prune at each check (default: none)."""
    select: Selector = attrs.field(
        factory=_default_select, validator=instance_of(Selector, "select")
    )
    """Which completed branch answers (default: highest PRM reward)."""
    interval: int = attrs.field(default=400, validator=int_at_least(1))
    """``T``: decode steps between checks (scoring, pruning, early stop)."""
    extract: Callable[[str], str] = attrs.field(default=extract_answer)
    """Turns a branch's text into its answer, for votes and results."""
    name: str = "custom"
    """Label used in reports."""
    pause: PauseRule = attrs.field(factory=PauseRule, validator=instance_of(PauseRule, "pause"))
    """Which running branches to pause first for more urgent requests (default: the
    lowest reward first)."""
    reward: RewardSource | None = attrs.field(default=None, validator=_reward_source)
    """This policy's own reward source, used for its requests instead of the driver's
    PRM (e.g. ``sart.ConfidenceScorer``: confidence from the policy's
    log-probabilities). ``None``: the driver's PRM."""
    admit: AdmitRule = attrs.field(factory=AdmitRule, validator=instance_of(AdmitRule, "admit"))
    """Settles the policy when its request is admitted, from the server's load (default:
    as given; ``sart.policies.adaptive.BranchByLoad`` chooses ``n`` by load)."""
    rebranch: RebranchRule = attrs.field(
        factory=RebranchRule, validator=instance_of(RebranchRule, "rebranch")
    )
    """Re-spends free seats on forks of live branches at checks (default: never;
    ``sart.policies.rebranch.Rebranch`` forks the best-rewarded ones)."""

    def __attrs_post_init__(self) -> None:
        self.stop.validate(self.n)
        self.prune.validate(self.n)

    @property
    def scores_running(self) -> bool:
        """Whether running branches need PRM rewards at each check."""
        return (self.prune.active and self.prune.needs_rewards) or self.rescores

    @property
    def rescores(self) -> bool:
        """Whether running branches are scored at every due check, also once the pruning
        budget is spent: a re-branching rule picks its parents by fresh rewards."""
        return self.rebranch.active and self.rebranch.needs_rewards

    @property
    def forks(self) -> bool:
        """Whether the policy may fork branches (its engine must support forking)."""
        return self.prune.forks or self.rebranch.active

    @property
    def scores_completed(self) -> bool:
        """Whether completed branches need a PRM reward (threshold, stop or selection)."""
        readers = self.select.needs_rewards or self.stop.needs_rewards
        return self.scores_running or (readers and self.n > 1)
