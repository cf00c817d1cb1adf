"""Engine adapters. Each lives in its own module and is imported only when used."""

from sart.engines.base import BranchDelta, BranchSpec, Engine, EngineStats, StepOutput

__all__ = ["BranchDelta", "BranchSpec", "Engine", "EngineStats", "StepOutput"]
