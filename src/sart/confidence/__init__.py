"""The policy's own confidence as a reward source: no PRM to serve.

``signals``
    The confidence signals (DeepConf's and log-probability ones), each a
    ``Signal`` whose ``Tracker`` follows one branch's log-probabilities.
``scorer``
    ``ConfidenceScorer``: one tracker per branch behind the PRM's interface
    (stateful, fed from two threads).

It sits below ``sart.policies`` (whose recipes build policies on it) and
imports nothing of the scheduler, so the policies and the driver's reward
routing (``sart.rewards``) both depend on it and not on each other's insides.
"""

from sart.confidence import signals
from sart.confidence.scorer import ConfidenceScorer
from sart.confidence.signals import *  # noqa: F403 - re-exported: the signals' names

__all__ = ["ConfidenceScorer", *signals.__all__]
