"""Where ``ConfidenceScorer`` and the confidence signals used to live: re-exported.

They are reward sources (stateful, fed from two threads), so they live beside the
PRMs now, in ``sart.rewards.confidence`` and ``sart.rewards.signals``; this module
keeps ``from sart.policies.confidence import ...`` working.
"""

from sart.rewards.confidence import ConfidenceScorer
from sart.rewards.signals import (
    NEUTRAL_REWARD,
    SIGNALS,
    GroupConfidence,
    LowestGroupConfidence,
    LowestTokenLogprob,
    MeanTokenLogprob,
    Signal,
    TailConfidence,
    TokenConfidence,
    Tracker,
    token_confidence,
)

__all__ = [
    "NEUTRAL_REWARD",
    "SIGNALS",
    "ConfidenceScorer",
    "GroupConfidence",
    "LowestGroupConfidence",
    "LowestTokenLogprob",
    "MeanTokenLogprob",
    "Signal",
    "TailConfidence",
    "TokenConfidence",
    "Tracker",
    "token_confidence",
]
