"""Where ``ConfidenceScorer`` and the confidence signals used to live: re-exported.

They are reward sources (stateful, fed from two threads), so they live beside the
PRMs now, in ``sart.rewards.confidence`` and ``sart.rewards.signals``; this module
keeps ``from sart.policies.confidence import ...`` working.
"""

from sart.rewards import signals
from sart.rewards.confidence import ConfidenceScorer
from sart.rewards.signals import *  # noqa: F403 - the signals' names, as before
from sart.rewards.signals import Tracker

__all__ = ["ConfidenceScorer", "Tracker", *signals.__all__]
