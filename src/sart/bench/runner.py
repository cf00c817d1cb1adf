"""The experiment runner: every method on the same trace, engine model and scheduler.

For each rate, one trace is generated (or loaded) with as many branches per
request as the largest ``n``; a method with ``n`` branches uses the first
``n`` of them. So Vanilla, Self-Consistency, SART without pruning and SART
see the same requests, arrival times and branches (common random numbers):
differences between them come from the method, not from sampling luck.

The simulator's PRM is ``ScriptedPRM`` (the trace's rewards), priced by
``sart.engines.prm_costs`` unless ``prm_cost="free"``: by default it
re-encodes every input, as vLLM's pooling PRM does, on its own accelerator of
the policy's kind, with overlapped scoring (see ``BenchConfig``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from sart.bench.traces import Trace, TraceRequest
from sart.bench.workloads import workload
from sart.driver import SyncDriver, TimelineSample
from sart.engines.base import ReportsUsage
from sart.engines.costs import H100, H200, cost_model
from sart.engines.prm_costs import PRMCostModel, PRMInput, PRMPricer, prm_serving
from sart.engines.sim import SimEngine
from sart.errors import ConfigError, config_check, enum_converter, int_at_least, number_above
from sart.methods import check_methods, get_method
from sart.metrics import RunSummary
from sart.policies.base import Policy
from sart.policies.equivalence import Equivalence
from sart.prm.base import PRM
from sart.prm.priced import CostedPRM
from sart.prm.scripted import ScriptedPRM
from sart.request import Request
from sart.results import RequestResult
from sart.types import Admission, SamplingSettings, Scoring


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
    grouping answers under ``equivalence`` and its answers read from a branch's text
    by ``extract``; ``None`` keeps the recipe's (exact strings; ``extract_answer``)."""
    policy = get_method(method).policy(n, interval)
    changes: dict[str, object] = {}
    select = policy.select
    if equivalence is not None and "equivalence" in attrs.fields_dict(type(select)):
        changes["select"] = attrs.evolve(select, equivalence=equivalence)
    if extract is not None:
        changes["extract"] = extract
    return attrs.evolve(policy, **changes)


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


# A field that a run does not use defaults to None, so that results.json never
# records a setting as if it had shaped the run.
def _default_workload(config: BenchConfig) -> str | None:
    return "gaokao" if config.engine == "sim" and config.trace is None else None


def _default_rates(config: BenchConfig) -> tuple[float, ...] | None:
    return None if config.trace is not None else (1.0, 4.0)


def _default_num_requests(config: BenchConfig) -> int | None:
    return None if config.trace is not None else 100


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
    cost: str = "h100-14b"
    methods: tuple[str, ...] = attrs.field(
        default=("vanilla", "sc", "rebase", "sart-no-prune", "sart"), converter=_tuple
    )
    ns: tuple[int, ...] = attrs.field(default=(2, 4, 8), converter=_tuple)
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
    scoring: Scoring = attrs.field(
        default=Scoring.OVERLAPPED, converter=enum_converter(Scoring, "scoring")
    )
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
        config_check(
            self.engine in ("sim", "hf", "vllm", "sglang"),
            "engine",
            self.engine,
            "'sim', 'hf', 'vllm' or 'sglang'",
        )
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


@attrs.frozen
class RunRecord:
    """One method at one ``n`` and one rate."""

    method: str
    n: int
    rate: float | None
    """Arrival rate (``None`` for a replayed trace)."""
    summary: RunSummary
    results: tuple[RequestResult, ...]
    timeline: tuple[TimelineSample, ...]
    request_usage: dict[str, tuple[tuple[float, int, int], ...]]
    """Per request: ``(time, live branches, KV tokens)`` after each decode call."""
    kv_capacity: int | None
    batch_size: int
    """The branch budget ``B`` the run used."""
    prm_busy: float = 0.0
    """Seconds the PRM spent scoring (``SyncDriver.prm_busy``)."""
    prm_wait: float = 0.0
    """Seconds decoding stood still waiting for the PRM (``SyncDriver.prm_wait``)."""
    prm_tokens: int | None = None
    """Tokens the priced PRM read (``None``: not priced)."""
    preemptions: int | None = None
    """Branches the simulated engine preempted for want of KV (``None``: a real engine,
    whose preemptions are its own)."""


def traces(config: BenchConfig) -> list[tuple[float | None, Trace]]:
    """The trace of each rate (one replayed trace when ``config.trace`` is set)."""
    if config.trace is not None:
        return [(None, Trace.load(config.trace))]
    model = workload(config.workload)
    width = max(config.ns)
    return [
        (rate, model.generate(config.num_requests, rate, width, config.interval, config.seed))
        for rate in config.rates
    ]


def run_method(
    trace: Trace,
    method: str,
    n: int,
    config: BenchConfig,
    rate: float | None = None,
    *,
    policy: Policy | None = None,
    per_request: Callable[[TraceRequest], dict[str, Any]] | None = None,
) -> RunRecord:
    """Serve ``trace`` with one method on a fresh simulated engine (``policy``, when
    given, instead of ``method_policy(method, n, config.interval)``;
    ``per_request(r)``: ``Request`` fields that replace those for trace request ``r``,
    e.g. its own ``policy`` and ``priority`` in a mixed workload)."""
    if n > trace.width:
        raise ConfigError(f"n={n} must be <= the trace's {trace.width} branches per request")
    if policy is None:
        policy = method_policy(method, n, config.interval)
    script = trace.script()
    batch_size = config.batch_size or auto_batch_size(config, trace)
    replicas = []
    for _ in range(config.replicas):
        engine = SimEngine(script, cost=config.cost, preemption=config.preemption)
        prm, pricer = sim_prm(config, ScriptedPRM(script, every=trace.interval or config.interval))
        driver = SyncDriver(
            engine,
            prm,
            batch_size=batch_size,
            admission=config.admission,
            scoring=method_scoring(method, config),
            poll_steps=config.poll_steps,
        )
        replicas.append((driver, engine, pricer))
    max_tokens = workload(config.workload).max_tokens if config.trace is None else None
    sampling = SamplingSettings(max_tokens=max_tokens or _trace_max_tokens(trace))
    requests = [
        Request(
            r.id,
            (0,) * r.prompt_tokens,
            **{
                "policy": policy,
                "sampling": sampling,
                "arrival": r.arrival,
                **(per_request(r) if per_request is not None else {}),
            },
        )
        for r in trace
    ]
    capacity = cost_model(config.cost).kv_capacity_tokens
    drivers = [driver for driver, _, _ in replicas]
    if len(drivers) == 1:
        record = serve(drivers[0], requests, trace.gold(), method, n, rate, capacity)
    else:
        record = serve_replicas(drivers, requests, trace.gold(), method, n, rate, capacity)
    pricers = [pricer for _, _, pricer in replicas if pricer is not None]
    return attrs.evolve(
        record,
        prm_tokens=sum(p.tokens for p in pricers) if pricers else None,
        preemptions=sum(engine.preemptions for _, engine, _ in replicas),
    )


def prm_cost_model(config: BenchConfig) -> PRMCostModel | None:
    """The simulated PRM's cost model (``None``: free, or a real engine's PRM).

    Each PRM replica runs on one accelerator (``prm_gpu``, by default of the
    policy's kind): another one (``own``), or the policy's (``shared``; under
    tensor parallelism one GPU of the group, which holds the whole group's
    decoding up)."""
    if config.prm_cost in (None, "free"):
        return None
    accelerator = (
        PRM_GPUS[config.prm_gpu] if config.prm_gpu else cost_model(config.cost).accelerator
    )
    assert accelerator is not None  # BenchConfig refuses a priced PRM without one
    return prm_serving(accelerator)


def sim_prm(config: BenchConfig, prm: PRM) -> tuple[PRM, PRMPricer | None]:
    """``prm`` priced as ``config`` says (with its pricer), or as it is when free."""
    model = prm_cost_model(config)
    if model is None:
        return prm, None
    pricer = PRMPricer(model, str(config.prm_cost))
    shared = config.prm_placement == "shared"
    replicas = config.prm_replicas or 1
    return CostedPRM(prm, pricer, shares_engine=shared, replicas=replicas), pricer


def serve(
    driver: SyncDriver,
    requests: Sequence[Request],
    gold: dict[str, str],
    method: str,
    n: int,
    rate: float | None,
    kv_capacity: int | None = None,
) -> RunRecord:
    """Run ``requests`` through ``driver``, sampling each request's resource use after
    every decode call (when the engine reports it: ``ReportsUsage``)."""
    for request in requests:
        driver.submit(request)
    usage: dict[str, list[tuple[float, int, int]]] = {}
    try:
        while _step_sampling(driver, usage):
            pass
    finally:
        driver.close()  # the PRM worker thread, if overlapped checks started one
    by_id = {res.request_id: res for res in driver.results}
    results = tuple(by_id[r.id] for r in requests)
    return RunRecord(
        method=method,
        n=n,
        rate=rate,
        summary=RunSummary.of(results, driver.timeline, gold),
        results=results,
        timeline=tuple(driver.timeline),
        request_usage={rid: tuple(v) for rid, v in usage.items()},
        kv_capacity=kv_capacity,
        batch_size=driver.scheduler.config.batch_size,
        prm_busy=driver.prm_busy,
        prm_wait=driver.prm_wait,
    )


def _step_sampling(driver: SyncDriver, usage: dict[str, list[tuple[float, int, int]]]) -> bool:
    """``driver.step()``; after a decode call, each request's ``(time, live branches, KV)``
    is appended to ``usage`` (when the engine reports it)."""
    decodes = len(driver.timeline)
    more = driver.step()
    engine = driver.engine
    if len(driver.timeline) != decodes and isinstance(engine, ReportsUsage):
        now = driver.timeline[-1].time
        for rid in engine.prefixes:
            live, kv = engine.usage(rid)
            usage.setdefault(rid, []).append((now, live, kv))
    return more


def serve_replicas(
    drivers: Sequence[SyncDriver],
    requests: Sequence[Request],
    gold: dict[str, str],
    method: str,
    n: int,
    rate: float | None,
    kv_capacity: int | None = None,
) -> RunRecord:
    """``serve`` on several replicas (each driver with its own engine and clock): the
    requests, in arrival order, each go to the replica with the fewest open requests
    at its arrival (ties: the lowest index), as a load-balancing router places them.
    Before a request is placed every replica runs until its clock reaches the arrival
    (or it has nothing to do); a replica in the middle of a decode chunk may be past
    it, as a real router sees load with some lag. The run's timeline is the fleet's:
    branches and KV summed over replicas, against ``kv_capacity`` times the number of
    replicas (each replica's own preemptions keep it within its cache)."""
    usage: dict[str, list[tuple[float, int, int]]] = {}
    try:
        for request in sorted(requests, key=lambda r: r.arrival):
            for driver in drivers:
                while driver.clock.now() < request.arrival and _step_sampling(driver, usage):
                    pass
            target = min(range(len(drivers)), key=lambda i: (drivers[i].open_requests, i))
            drivers[target].submit(request)
        for driver in drivers:
            while _step_sampling(driver, usage):
                pass
    finally:
        for driver in drivers:
            driver.close()
    by_id = {res.request_id: res for driver in drivers for res in driver.results}
    results = tuple(by_id[r.id] for r in requests)
    timeline = _fleet_timeline([d.timeline for d in drivers])
    return RunRecord(
        method=method,
        n=n,
        rate=rate,
        summary=RunSummary.of(results, list(timeline), gold),
        results=results,
        timeline=timeline,
        request_usage={rid: tuple(v) for rid, v in usage.items()},
        kv_capacity=None if kv_capacity is None else kv_capacity * len(drivers),
        batch_size=drivers[0].scheduler.config.batch_size * len(drivers),
        prm_busy=sum(d.prm_busy for d in drivers),
        prm_wait=sum(d.prm_wait for d in drivers),
    )


def _fleet_timeline(timelines: Sequence[Sequence[TimelineSample]]) -> tuple[TimelineSample, ...]:
    """Replicas' timelines as one: at each sample, every replica's latest values summed."""
    events = sorted((s.time, i, s) for i, timeline in enumerate(timelines) for s in timeline)
    latest: dict[int, TimelineSample] = {}
    out = []
    for time, i, sample in events:
        latest[i] = sample
        out.append(
            TimelineSample(
                time,
                sum(s.running_branches for s in latest.values()),
                sum(s.kv_tokens for s in latest.values()),
            )
        )
    return tuple(out)


#: Without a KV capacity (the ``steps`` model) the branch budget defaults to this.
DEFAULT_BATCH_SIZE = 64


def auto_batch_size(config: BenchConfig, trace: Trace) -> int:
    """The branch budget ``B`` that fits a typical batch in the KV cache: capacity
    divided by (prompt + 1.25 x the median branch length, from the workload
    preset, or from the trace when replaying one). Long branches can still push
    a run past capacity; the report flags it."""
    capacity = cost_model(config.cost).kv_capacity_tokens
    if capacity is None:
        return DEFAULT_BATCH_SIZE
    if config.trace is None:  # the workload's own numbers: one B for every rate
        model = workload(config.workload)
        prompt, median = float(model.prompt_tokens), model.median_length
    else:
        lengths = sorted(b.length for r in trace for b in r.branches)
        prompt = sum(r.prompt_tokens for r in trace) / len(trace)
        median = lengths[len(lengths) // 2]
    return max(1, int(capacity // (prompt + 1.25 * median)))


def _trace_max_tokens(trace: Trace) -> int:
    # A replayed trace carries no max_tokens: branches end where the trace says.
    return max(b.length for r in trace for b in r.branches)


def plan(config: BenchConfig) -> list[tuple[str, int]]:
    """(method, n) pairs to run per rate; Vanilla runs once (n = 1)."""
    pairs: list[tuple[str, int]] = []
    for method in config.methods:
        if method == "vanilla":
            pairs.append((method, 1))
        else:
            pairs.extend((method, n) for n in config.ns)
    return pairs


def run_bench(
    config: BenchConfig, on_run: Callable[[RunRecord], None] | None = None
) -> list[RunRecord]:
    """Every (method, n) on every rate's trace."""
    records = []
    for rate, trace in traces(config):
        for method, n in plan(config):
            record = run_method(trace, method, n, config, rate)
            records.append(record)
            if on_run is not None:
                on_run(record)
    return records
