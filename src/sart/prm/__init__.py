"""Process reward models. Adapters live in their own modules and load lazily."""

from sart.prm.base import PRM, PricedPRM, ScoreItem, validate_reward
from sart.prm.priced import CostedPRM

__all__ = ["PRM", "CostedPRM", "PricedPRM", "ScoreItem", "validate_reward"]
