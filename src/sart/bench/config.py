"""``BenchConfig``: what one ``sart bench`` experiment runs, checked, with its defaults;
and the policy and scoring each method runs with in it.

The simulator's PRM is priced by ``sart.engines.prm_costs`` unless
``prm_cost="free"``: by default it re-encodes every input, as vLLM's pooling PRM
does, on its own accelerator of the policy's kind, with overlapped scoring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from sart.bench.workloads import workload
from sart.engines.costs import H100, H200, cost_model
from sart.engines.prm_costs import PRMInput
from sart.errors import ConfigError, config_check, int_at_least, number_above
from sart.methods import check_methods, get_method, grouped_by
from sart.policies.base import Policy
from sart.policies.equivalence import Equivalence
from sart.registry import step_engines
from sart.scheduler.config import to_scoring
from sart.types import Admission, Scoring


def method_policy(
    method: str,
    n: int,
    interval: int,
    *,
    equivalence: Equivalence | None = None,
    extract: Callable[[str], str] | None = None,
) -> Policy:
    """The registered ``method``'s policy (``sart.methods``) for ``n`` branches
    checked every ``interval`` tokens, its votes (``MajorityVote``, ``WeightedVote``)
    and agreement stop (``Agreement``) grouping answers under ``equivalence`` and its
    answers read from a branch's text by ``extract``; ``None`` keeps the recipe's
    (exact strings; ``extract_answer``)."""
    policy = get_method(method).policy(n, interval)
    if equivalence is not None:
        policy = grouped_by(policy, equivalence)
    if extract is not None:
        policy = attrs.evolve(policy, extract=extract)
    return policy


def method_scoring(method: str, config: BenchConfig) -> Scoring:
    """How ``method``'s checks are scored: ``config.scoring``, unless the method fixes
    its own (``sart-blocking``)."""
    return get_method(method).scoring_in(config.scoring)


#: ``prm_cost`` choices: a PRM that costs nothing, or priced reading inputs one ``PRMInput`` way.
PRM_COSTS = ("free", *(mode.value for mode in PRMInput))
#: ``prm_placement`` choices: the PRM on its own accelerator, or sharing the policy's.
PRM_PLACEMENTS = ("own", "shared")


def _tuple(value: Sequence) -> tuple:
    return tuple(value)


def _optional_tuple(value: Sequence | None) -> tuple | None:
    return None if value is None else tuple(value)


DEFAULT_METHODS = ("vanilla", "sc", "rebase", "sart-no-prune", "sart")
"""The methods a benchmark compares when it is not told."""
DEFAULT_NS: tuple[int, ...] = (2, 4, 8)
DEFAULT_RATES: tuple[float, ...] = (1.0, 4.0)
DEFAULT_REQUESTS = 200
"""Requests per run of a generated workload (or a real engine's prompts)."""
DEFAULT_COST_MODEL = "h100-14b"
"""The simulated accelerator and model: one H100 serving a 14B model."""


# A field that a run does not use defaults to None, so that results.json never
# records a setting as if it had shaped the run.
def _default_workload(config: BenchConfig) -> str | None:
    return "gaokao" if config.engine == "sim" and config.trace is None else None


def _default_rates(config: BenchConfig) -> tuple[float, ...] | None:
    return None if config.trace is not None else DEFAULT_RATES


def _default_num_requests(config: BenchConfig) -> int | None:
    return None if config.trace is not None else DEFAULT_REQUESTS


def _default_prm_cost(config: BenchConfig) -> str | None:
    # Re-encoding is what the paper's deployment did (vLLM serves its PRM as a
    # pooling model, which cannot reuse a cache); the ``steps`` model has no
    # seconds to price a PRM in, and a real engine's PRM takes real time.
    if config.engine != "sim":
        return None
    return "free" if cost_model(config.cost).accelerator is None else PRMInput.REENCODE.value


def _default_prm_placement(config: BenchConfig) -> str | None:
    return "own" if config.engine == "sim" else None


def _default_prm_replicas(config: BenchConfig) -> int | None:
    return 1 if config.engine == "sim" else None


#: ``prm_gpu`` choices: the accelerator each simulated PRM replica runs on.
PRM_GPUS = {"h100": H100, "h200": H200}


@attrs.frozen
class BenchConfig:
    """One benchmark: methods x N values x rates on one workload and one engine model."""

    engine: str = "sim"
    """``sim`` (simulated, the default), ``hf`` (a transformers model, wall clock) or
    ``vllm`` (a model served by vLLM in this process, wall clock)."""
    model: str | None = None
    """``hf``, ``vllm``: the model's path (``sim`` uses ``cost``)."""
    trace: str | None = None
    """Replay this JSONL trace instead of generating one per rate (``sim`` only)."""
    workload: str | None = attrs.field(default=attrs.Factory(_default_workload, takes_self=True))
    """The generated workload (default ``gaokao``); ``None``, and only ``None``, where
    none is generated: replaying a trace, or on a real engine."""
    cost: str = DEFAULT_COST_MODEL
    methods: tuple[str, ...] = attrs.field(default=DEFAULT_METHODS, converter=_tuple)
    ns: tuple[int, ...] = attrs.field(default=DEFAULT_NS, converter=_tuple)
    rates: tuple[float, ...] | None = attrs.field(
        default=attrs.Factory(_default_rates, takes_self=True), converter=_optional_tuple
    )
    """Arrival rates, one run each; ``None``, and only ``None``, replaying a trace
    (whose own arrival times are replayed)."""
    num_requests: int | None = attrs.field(
        default=attrs.Factory(_default_num_requests, takes_self=True)
    )
    """Requests per generated run; ``None`` where they come from elsewhere (a trace,
    a real engine's prompt file)."""
    batch_size: int | None = None
    """``B``; ``None`` sizes it to the model's KV capacity (``auto_batch_size``)."""
    interval: int = 400
    seed: int = 0
    admission: Admission = attrs.field(default=Admission.CHUNK, converter=Admission)
    scoring: Scoring = attrs.field(default=Scoring.OVERLAPPED, converter=to_scoring)
    """Whether decoding waits for PRM checks (Algorithm 1 as written) or goes on meanwhile."""
    poll_steps: int | None = None
    """Overlapped scoring: the longest decode chunk while a PRM call is in flight
    (``None``: the scheduler's default, an eighth of ``interval``)."""
    prm_cost: str | None = attrs.field(default=attrs.Factory(_default_prm_cost, takes_self=True))
    """``sim``: how the PRM is priced, one of ``PRM_COSTS`` (default ``reencode``, or
    ``free`` under the ``steps`` model); ``None`` on a real engine."""
    prm_placement: str | None = attrs.field(
        default=attrs.Factory(_default_prm_placement, takes_self=True)
    )
    """``sim``: the PRM on its ``own`` accelerator (default) or ``shared`` with the
    policy (a call holds decoding up); ``None`` on a real engine."""
    prm_replicas: int | None = attrs.field(
        default=attrs.Factory(_default_prm_replicas, takes_self=True)
    )
    """``sim``: PRM replicas, each on its own accelerator, scoring checks side by side
    (the driver keeps as many ``Score`` commands in flight: ``SchedulerConfig.max_scores``);
    every engine replica (``replicas``) has this many. ``None`` on a real engine."""
    prm_gpu: str | None = None
    """``sim``: the accelerator of each PRM replica, one of ``PRM_GPUS`` (``None``: the
    policy's kind)."""
    replicas: int = attrs.field(default=1, validator=int_at_least(1))
    """``sim``: engine replicas (data parallel), each with its own budget ``B``, KV
    cache and PRM; a request goes, at its arrival, to the replica with the fewest
    open requests (ties: the lowest index), and all its branches run there."""
    preemption: bool = True
    """``sim``: model vLLM's preemption when the live branches' KV outgrows the cost
    model's capacity (``SimEngine``); ``False`` prices such runs as if memory were
    unlimited (and flags them)."""
    slo: float | None = attrs.field(default=None, validator=number_above(0, optional=True))
    """A latency objective (end to end, in the clock's unit): each run also reports
    the fraction of its requests answered within it (``sart.metrics.slo_attainment``).
    It changes nothing in how requests are served."""

    def __attrs_post_init__(self) -> None:
        check_methods(self.methods)
        config_check(bool(self.methods), "methods", self.methods, "non-empty")
        config_check(bool(self.ns) and min(self.ns) >= 1, "ns", self.ns, "non-empty, each >= 1")
        engines = ["sim", *step_engines()]
        config_check(self.engine in engines, "engine", self.engine, f"one of {engines}")
        self._check_sources()
        config_check(
            self.batch_size is None or self.batch_size >= 1,
            "batch_size",
            self.batch_size,
            "None (auto) or >= 1",
        )
        config_check(self.interval >= 1, "interval", self.interval, ">= 1")
        cost_model(self.cost)
        config_check(
            self.poll_steps is None or self.poll_steps >= 1,
            "poll_steps",
            self.poll_steps,
            "None or >= 1",
        )
        if self.engine != "sim":
            for name in ("prm_cost", "prm_placement", "prm_replicas", "prm_gpu"):
                value = getattr(self, name)
                config_check(value is None, name, value, "None for a real engine (its PRM is real)")
            return
        config_check(
            isinstance(self.prm_replicas, int) and self.prm_replicas >= 1,
            "prm_replicas",
            self.prm_replicas,
            "an int >= 1",
        )
        config_check(
            self.prm_gpu is None or self.prm_gpu in PRM_GPUS,
            "prm_gpu",
            self.prm_gpu,
            f"None or one of {sorted(PRM_GPUS)}",
        )
        shared = self.prm_placement == "shared"
        config_check(
            not shared or (self.prm_replicas == 1 and self.prm_gpu is None),
            "prm_placement",
            self.prm_placement,
            "'own' with prm_replicas > 1 or a prm_gpu (a shared PRM is the policy's GPU)",
        )
        config_check(self.prm_cost in PRM_COSTS, "prm_cost", self.prm_cost, f"one of {PRM_COSTS}")
        config_check(
            self.prm_placement in PRM_PLACEMENTS,
            "prm_placement",
            self.prm_placement,
            f"one of {PRM_PLACEMENTS}",
        )
        config_check(
            self.prm_cost == "free" or cost_model(self.cost).accelerator is not None,
            "prm_cost",
            self.prm_cost,
            f"'free' under cost={self.cost!r}, which counts decode steps, not seconds",
        )

    def _check_sources(self) -> None:
        """Where requests come from -- a generated workload, a trace, or a real
        engine's prompts -- and only the fields that source uses are set."""
        unused = "has no effect " + (
            "with a trace (its own requests and arrival times are replayed)"
            if self.trace is not None
            else f"on engine {self.engine!r} (it serves prompts, not a generated workload)"
        )
        config_check(
            self.trace is None or self.engine == "sim",
            "trace",
            self.trace,
            "None unless engine='sim'",
        )
        if self.workload is not None:
            if self.engine != "sim" or self.trace is not None:
                raise ConfigError(f"workload={self.workload!r} {unused}")
            workload(self.workload)
        elif self.engine == "sim" and self.trace is None:
            raise ConfigError("workload=None: a simulated run needs a workload or a trace")
        if self.trace is not None:
            for name in ("rates", "num_requests"):
                value = getattr(self, name)
                if value is not None:
                    raise ConfigError(f"{name}={value!r} {unused}")
            return
        config_check(
            bool(self.rates) and min(self.rates or (0,)) > 0,
            "rates",
            self.rates,
            "non-empty, each > 0",
        )
        # A real engine's requests may come from a prompt file (None), a workload's never.
        optional = self.engine != "sim" and self.num_requests is None
        config_check(
            optional or (self.num_requests or 0) >= 1, "num_requests", self.num_requests, ">= 1"
        )
