"""sart: short and right LLM reasoning.

Serve reasoning requests with ``n`` parallel branches per request, stop once
``m`` complete, prune low-reward branches with a process reward model, and
schedule many requests under a branch budget (Algorithm 1 of the SART paper).

``import sart`` loads only the pure core: no torch, no engine. Engines and
PRMs load lazily by name (see ``sart.registry``).
"""

from sart import policies
from sart.answers import extract_answer
from sart.async_driver import AsyncDriver
from sart.clock import Clock, VirtualClock, WallClock
from sart.driver import TimelineSample
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
from sart.policies import *  # noqa: F403 -- every policy part and recipe: sart.policies.__all__
from sart.prm.base import PRM, PricedPRM
from sart.prm.priced import CostedPRM
from sart.registry import load_engine, load_prm, register_engine, register_prm
from sart.request import Request
from sart.results import BranchOutcome, RequestResult, Timings
from sart.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from sart.state import RequestMeta
from sart.sync_driver import SyncDriver, run
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
    "AsyncDriver",
    "AsyncEngine",
    "BranchDelta",
    "BranchId",
    "BranchOutcome",
    "BranchSpec",
    "BranchStatus",
    "BranchView",
    "Clock",
    "ConfigError",
    "CostedPRM",
    "Engine",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "Limits",
    "Load",
    "MissingDependencyError",
    "PRMError",
    "Phase",
    "PricedPRM",
    "ReportsUsage",
    "Request",
    "RequestMeta",
    "RequestRefused",
    "RequestResult",
    "RequestStatus",
    "RequestView",
    "SamplingSettings",
    "SartError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStats",
    "ScoreItem",
    "Scoring",
    "StepOutput",
    "SyncDriver",
    "TimelineSample",
    "Timings",
    "TokenLogprobs",
    "UnknownComponentError",
    "VirtualClock",
    "WallClock",
    "extract_answer",
    "load_engine",
    "load_prm",
    "register_engine",
    "register_prm",
    "run",
]
__all__ += policies.__all__  # one list of the policy names, kept in sart.policies
