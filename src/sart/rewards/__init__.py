"""Where a request's rewards come from, for the driver: routing and failure isolation.

``router``
    ``RewardRouter``: which source scores each request (its policy's own, else
    the driver's PRM), log-probabilities wanted, token observation, release.
``isolation``
    ``score_items``: one PRM call, a failure confined to the requests at fault;
    ``prm_workers`` / ``prm_replicas``: calls a PRM takes side by side.

The policy's own confidence (``ConfidenceScorer`` and its signals) lives in
``sart.confidence``, below the policies; it is re-exported here, as the reward
source beside the PRMs.
"""

from sart.confidence import *  # noqa: F403 - re-exported: ConfidenceScorer and the signals
from sart.confidence import __all__ as _confidence_names
from sart.rewards.isolation import prm_replicas, prm_workers, score_items
from sart.rewards.router import RewardRouter

__all__ = ["RewardRouter", "prm_replicas", "prm_workers", "score_items", *_confidence_names]
