"""Selectors: which completed branch gives the request's answer.

Ties are broken the same way everywhere: the branch (or answer) that
completed first wins, then the lowest branch index. That keeps selection
deterministic and favours short reasoning, in the spirit of the paper.

The votes group answers under an ``Equivalence`` (``sart.policies.equivalence``):
exact strings by default, or the user's (``sart.eval.MathVerifyEquivalence``
counts ``\\frac12`` and ``0.5`` together).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from sart.policies.base import Selector
from sart.policies.equivalence import Equivalence, ExactMatch, check_equivalence, group_answers
from sart.views import BranchView, completion_order


def _reward(branch: BranchView) -> float:
    return branch.reward if branch.reward is not None else float("-inf")


@attrs.frozen
class BestReward(Selector):
    """The completed branch with the highest PRM reward (the paper's default)."""

    needs_rewards = True

    def choose(self, candidates: Sequence[BranchView], answers: Sequence[str]) -> int:
        best = min(candidates, key=lambda b: (-_reward(b), *completion_order(b)))
        return best.index


@attrs.frozen
class MajorityVote(Selector):
    """The most frequent answer (Self-Consistency); its first-completed branch is chosen.

    Answers come from the policy's ``extract`` function (default: the last
    ``\\boxed{...}``, else the last line); pass ``Policy(extract=...)`` to change it.
    Answers count together when ``equivalence`` says they are the same
    (default: equal strings).
    """

    needs_rewards = False

    equivalence: Equivalence = attrs.field(
        factory=ExactMatch, validator=check_equivalence, kw_only=True
    )
    """Which answers are one answer (default ``ExactMatch()``)."""

    def choose(self, candidates: Sequence[BranchView], answers: Sequence[str]) -> int:
        groups = group_answers(candidates, answers, self.equivalence)
        # Groups come in completion order of their first branch, so max() keeps
        # the earliest answer among equals.
        winner = max(groups, key=len)
        return winner[0].index


@attrs.frozen
class WeightedVote(Selector):
    """The answer with the largest sum of PRM rewards; its best-rewarded branch is chosen.

    Answers count together when ``equivalence`` says they are the same
    (default: equal strings).
    """

    needs_rewards = True

    equivalence: Equivalence = attrs.field(
        factory=ExactMatch, validator=check_equivalence, kw_only=True
    )
    """Which answers are one answer (default ``ExactMatch()``)."""

    def choose(self, candidates: Sequence[BranchView], answers: Sequence[str]) -> int:
        groups = group_answers(candidates, answers, self.equivalence)
        winner = max(
            groups,
            key=lambda group: sum(b.reward for b in group if b.reward is not None),
        )
        return min(winner, key=lambda b: (-_reward(b), *completion_order(b))).index
