"""Selectors: which completed branch gives the request's answer.

Ties are broken the same way everywhere: the branch (or answer) that
completed first wins, then the lowest branch index. That keeps selection
deterministic and favours short reasoning, in the spirit of the paper.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from sart.policies.base import Selector
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


def _voting(
    candidates: Sequence[BranchView], answers: Sequence[str]
) -> dict[str, list[BranchView]]:
    """Branches grouped by answer, each group in completion order; empty answers
    (nothing extractable) vote only if no branch has an answer."""
    groups: dict[str, list[BranchView]] = {}
    for branch, answer in sorted(zip(candidates, answers), key=lambda p: completion_order(p[0])):
        groups.setdefault(answer, []).append(branch)
    if len(groups) > 1:
        groups.pop("", None)
    return groups


@attrs.frozen
class MajorityVote(Selector):
    """The most frequent answer (Self-Consistency); its first-completed branch is chosen.

    Answers come from the policy's ``extract`` function (default: the last
    ``\\boxed{...}``, else the last line); pass ``Policy(extract=...)`` to change it.
    """

    def choose(self, candidates: Sequence[BranchView], answers: Sequence[str]) -> int:
        groups = _voting(candidates, answers)
        # dicts keep insertion order = completion order of each answer's first branch,
        # so max() keeps the earliest answer among equals.
        winner = max(groups.values(), key=len)
        return winner[0].index


@attrs.frozen
class WeightedVote(Selector):
    """The answer with the largest sum of PRM rewards; its best-rewarded branch is chosen."""

    needs_rewards = True

    def choose(self, candidates: Sequence[BranchView], answers: Sequence[str]) -> int:
        groups = _voting(candidates, answers)
        winner = max(
            groups.values(),
            key=lambda group: sum(b.reward for b in group if b.reward is not None),
        )
        return min(winner, key=lambda b: (-_reward(b), *completion_order(b))).index
