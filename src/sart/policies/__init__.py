"""Policies: what to stop on, what to prune, which answer to pick, and the recipes."""

from sart.confidence import ConfidenceScorer
from sart.confidence.signals import (
    GroupConfidence,
    LowestGroupConfidence,
    LowestTokenLogprob,
    MeanTokenLogprob,
    Signal,
    TailConfidence,
    TokenConfidence,
)
from sart.policies.adaptive import BranchByLoad, ShedUnderLoad
from sart.policies.base import (
    AdmitRule,
    PauseRule,
    Policy,
    PruneRule,
    RebranchRule,
    RewardSource,
    Selector,
    StopRule,
)
from sart.policies.equivalence import Equivalence, ExactMatch
from sart.policies.particle import Resample
from sart.policies.prune import NoPrune, TwoPhasePrune, WarmupThreshold
from sart.policies.rebranch import Rebranch
from sart.policies.recipes import (
    deepconf_online,
    particle_filter,
    rebase,
    sart,
    sart_adaptive,
    sart_confidence,
    sart_rebranch,
    sart_without_pruning,
    self_consistency,
    vanilla,
)
from sart.policies.reward_balance import Reshare, RewardBalance
from sart.policies.select import BestReward, MajorityVote, WeightedVote
from sart.policies.stop import Agreement, AllDone, FirstM

__all__ = [
    "AdmitRule",
    "Agreement",
    "AllDone",
    "BestReward",
    "BranchByLoad",
    "ConfidenceScorer",
    "Equivalence",
    "ExactMatch",
    "FirstM",
    "GroupConfidence",
    "LowestGroupConfidence",
    "LowestTokenLogprob",
    "MajorityVote",
    "MeanTokenLogprob",
    "NoPrune",
    "PauseRule",
    "Policy",
    "PruneRule",
    "Rebranch",
    "RebranchRule",
    "Resample",
    "Reshare",
    "RewardBalance",
    "RewardSource",
    "Selector",
    "ShedUnderLoad",
    "Signal",
    "StopRule",
    "TailConfidence",
    "TokenConfidence",
    "TwoPhasePrune",
    "WarmupThreshold",
    "WeightedVote",
    "deepconf_online",
    "particle_filter",
    "rebase",
    "sart",
    "sart_adaptive",
    "sart_confidence",
    "sart_rebranch",
    "sart_without_pruning",
    "self_consistency",
    "vanilla",
]
