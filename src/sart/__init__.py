"""sart: short and right LLM reasoning.

Serve reasoning requests with ``n`` parallel branches per request, stop once
``m`` complete, prune low-reward branches with a process reward model, and
schedule many requests under a branch budget (Algorithm 1 of the SART paper).

``import sart`` loads only the pure core: no torch, no engine. Engines and
PRMs load lazily by name (see ``sart.registry``).
"""

from sart.answers import extract_answer
from sart.async_driver import AsyncDriver
from sart.clock import Clock, VirtualClock, WallClock
from sart.driver import SyncDriver, TimelineSample, run
from sart.engines.base import AsyncEngine, Engine, EngineStats, ReportsUsage
from sart.errors import (
    ConfigError,
    EngineError,
    MissingDependencyError,
    PRMError,
    RequestRefused,
    SartError,
    SchedulerError,
    UnknownComponentError,
)
from sart.messages import BranchDelta, BranchSpec, ScoreItem, StepOutput, TokenLogprobs
from sart.policies import (
    AdmitRule,
    AllDone,
    BestReward,
    BranchByLoad,
    ConfidenceScorer,
    Equivalence,
    ExactMatch,
    FirstM,
    GroupConfidence,
    LowestGroupConfidence,
    LowestTokenLogprob,
    MajorityVote,
    MeanTokenLogprob,
    NoPrune,
    PauseRule,
    Policy,
    PruneRule,
    RewardBalance,
    RewardSource,
    Selector,
    ShedUnderLoad,
    Signal,
    StopRule,
    TailConfidence,
    TokenConfidence,
    TwoPhasePrune,
    WarmupThreshold,
    WeightedVote,
    deepconf_online,
    rebase,
    sart,
    sart_adaptive,
    sart_confidence,
    sart_without_pruning,
    self_consistency,
    vanilla,
)
from sart.prm.base import PRM, PricedPRM
from sart.prm.priced import CostedPRM
from sart.registry import load_engine, load_prm, register_engine, register_prm
from sart.request import Request
from sart.results import BranchOutcome, RequestResult, Timings
from sart.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from sart.state import RequestMeta
from sart.types import (
    Admission,
    BranchId,
    BranchStatus,
    FinishReason,
    Phase,
    RequestStatus,
    SamplingSettings,
    Scoring,
)
from sart.views import BranchView, Limits, Load, RequestView

__version__ = "0.1.0.dev0"

__all__ = [
    "PRM",
    "Admission",
    "AdmitRule",
    "AllDone",
    "AsyncDriver",
    "AsyncEngine",
    "BestReward",
    "BranchByLoad",
    "BranchDelta",
    "BranchId",
    "BranchOutcome",
    "BranchSpec",
    "BranchStatus",
    "BranchView",
    "Clock",
    "ConfidenceScorer",
    "ConfigError",
    "CostedPRM",
    "Engine",
    "EngineError",
    "EngineStats",
    "Equivalence",
    "ExactMatch",
    "FinishReason",
    "FirstM",
    "GroupConfidence",
    "Limits",
    "Load",
    "LowestGroupConfidence",
    "LowestTokenLogprob",
    "MajorityVote",
    "MeanTokenLogprob",
    "MissingDependencyError",
    "NoPrune",
    "PRMError",
    "PauseRule",
    "Phase",
    "Policy",
    "PricedPRM",
    "PruneRule",
    "ReportsUsage",
    "Request",
    "RequestMeta",
    "RequestRefused",
    "RequestResult",
    "RequestStatus",
    "RequestView",
    "RewardBalance",
    "RewardSource",
    "SamplingSettings",
    "SartError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStats",
    "ScoreItem",
    "Scoring",
    "Selector",
    "ShedUnderLoad",
    "Signal",
    "StepOutput",
    "StopRule",
    "SyncDriver",
    "TailConfidence",
    "TimelineSample",
    "Timings",
    "TokenConfidence",
    "TokenLogprobs",
    "TwoPhasePrune",
    "UnknownComponentError",
    "VirtualClock",
    "WallClock",
    "WarmupThreshold",
    "WeightedVote",
    "deepconf_online",
    "extract_answer",
    "load_engine",
    "load_prm",
    "rebase",
    "register_engine",
    "register_prm",
    "run",
    "sart",
    "sart_adaptive",
    "sart_confidence",
    "sart_without_pruning",
    "self_consistency",
    "vanilla",
]
