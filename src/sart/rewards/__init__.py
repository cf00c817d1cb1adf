"""Reward sources beside the PRMs: routing, failure isolation, and confidence.

``router``
    ``RewardRouter``: which source scores each request (its policy's own, else
    the driver's PRM), log-probabilities wanted, token observation, release.
``isolation``
    ``score_items``: one PRM call, a failure confined to the requests at fault;
    ``prm_workers`` / ``prm_replicas``: calls a PRM takes side by side.
``confidence``
    ``ConfidenceScorer``: rewards from the policy's own log-probabilities
    (stateful, fed from two threads), behind the PRM's interface.
``signals``
    The confidence signals it reads (DeepConf's and log-probability ones).

The stateful reward machinery lives here so that ``sart.policies`` holds only
pure rules; ``sart.policies`` still re-exports ``ConfidenceScorer`` and the
signals.
"""

from typing import Any

from sart.rewards import signals
from sart.rewards.confidence import ConfidenceScorer
from sart.rewards.signals import *  # noqa: F403 - re-exported: the signals' names

# ``router`` and ``isolation`` import the commands, which import the policies, which
# re-export ``ConfidenceScorer`` from here: they load on first use.
_LAZY = {
    "RewardRouter": "sart.rewards.router",
    "prm_replicas": "sart.rewards.isolation",
    "prm_workers": "sart.rewards.isolation",
    "score_items": "sart.rewards.isolation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sart.rewards' has no attribute {name!r}")


__all__ = ["ConfidenceScorer", *_LAZY, *signals.__all__]
