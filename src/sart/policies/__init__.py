"""Policies: what to stop on, what to prune, which answer to pick, and the recipes."""

from sart.policies.base import Policy, PruneRule, Selector, StopRule
from sart.policies.equivalence import Equivalence, ExactMatch
from sart.policies.prune import NoPrune, TwoPhasePrune
from sart.policies.rebase import RewardBalance
from sart.policies.recipes import (
    rebase,
    sart,
    sart_without_pruning,
    self_consistency,
    vanilla,
)
from sart.policies.select import BestReward, MajorityVote, WeightedVote
from sart.policies.stop import AllDone, FirstM

__all__ = [
    "AllDone",
    "BestReward",
    "Equivalence",
    "ExactMatch",
    "FirstM",
    "MajorityVote",
    "NoPrune",
    "Policy",
    "PruneRule",
    "RewardBalance",
    "Selector",
    "StopRule",
    "TwoPhasePrune",
    "WeightedVote",
    "rebase",
    "sart",
    "sart_without_pruning",
    "self_consistency",
    "vanilla",
]
