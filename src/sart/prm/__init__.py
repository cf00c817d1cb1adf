"""Process reward models. Adapters live in their own modules and load lazily."""

from sart.prm.base import PRM, ScoreItem, validate_reward

__all__ = ["PRM", "ScoreItem", "validate_reward"]
