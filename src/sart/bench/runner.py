"""The experiment runner: every method on the same trace, engine model and scheduler.

For each rate, one trace is generated (or loaded) with as many branches per
request as the largest ``n``; a method with ``n`` branches uses the first
``n`` of them. So Vanilla, Self-Consistency, SART without pruning and SART
see the same requests, arrival times and branches (common random numbers):
differences between them come from the method, not from sampling luck.

The simulator's PRM is ``ScriptedPRM`` (the trace's rewards), priced as
``BenchConfig`` (``sart.bench.config``) says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from sart.bench.config import (
    PRM_COSTS,
    PRM_GPUS,
    PRM_PLACEMENTS,
    BenchConfig,
    method_policy,
    method_scoring,
)
from sart.bench.traces import Trace, TraceRequest
from sart.bench.workloads import workload
from sart.driver import TimelineSample
from sart.engines.base import ReportsUsage
from sart.engines.costs import cost_model
from sart.engines.prm_costs import PRMCostModel, PRMPricer, prm_serving
from sart.engines.sim import SimEngine
from sart.errors import ConfigError
from sart.metrics import RunSummary
from sart.policies.base import Policy
from sart.prm.base import PRM
from sart.prm.priced import CostedPRM
from sart.prm.scripted import ScriptedPRM
from sart.request import Request
from sart.results import RequestResult
from sart.sync_driver import SyncDriver
from sart.types import SamplingSettings


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
    kv_overflowed: bool = False
    """A simulated engine without preemption needed more KV than its capacity at some
    step. The timeline samples KV between decode calls, so it misses a peak reached
    inside a call (branches grow during it and are freed at its end); the engine
    checks every step."""

    @property
    def over_capacity(self) -> bool:
        """Whether the run held more KV than fits: on a real engine it would preempt."""
        sampled = self.kv_capacity is not None and self.summary.peak_kv_tokens > self.kv_capacity
        return self.kv_overflowed or sampled


def traces(config: BenchConfig) -> list[tuple[float | None, Trace]]:
    """The trace of each rate (one replayed trace when ``config.trace`` is set)."""
    if config.trace is not None:
        return [(None, Trace.load(config.trace))]
    # Without a trace BenchConfig requires all three.
    assert config.workload and config.num_requests is not None and config.rates is not None
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
    script = trace.script(every=trace.interval or config.interval)
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
    max_tokens = None
    if config.trace is None:
        assert config.workload  # BenchConfig requires one without a trace
        max_tokens = workload(config.workload).max_tokens
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
    record = serve(drivers, requests, trace.gold(), method, n, rate, capacity)
    pricers = [pricer for _, _, pricer in replicas if pricer is not None]
    return attrs.evolve(
        record,
        prm_tokens=sum(p.tokens for p in pricers) if pricers else None,
        preemptions=sum(engine.preemptions for _, engine, _ in replicas),
        kv_overflowed=capacity is not None
        and any(engine.peak_kv_tokens > capacity for _, engine, _ in replicas),
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
    drivers: SyncDriver | Sequence[SyncDriver],
    requests: Sequence[Request],
    gold: dict[str, str],
    method: str,
    n: int,
    rate: float | None,
    kv_capacity: int | None = None,
) -> RunRecord:
    """Run ``requests`` through a driver, or on several replicas (a driver each, with its
    own engine and clock), sampling each request's resource use after every decode call
    (when the engine reports it: ``ReportsUsage``).

    On several replicas the requests, in arrival order, each go to the replica with the
    fewest open requests at its arrival (ties: the lowest index), as a load-balancing
    router places them. Before a request is placed every replica runs until its clock
    reaches the arrival (or it has nothing to do); a replica in the middle of a decode
    chunk may be past it, as a real router sees load with some lag. The run's timeline
    is then the fleet's: branches and KV summed over replicas, against ``kv_capacity``
    times the number of replicas (each replica's own preemptions keep it within its
    cache)."""
    fleet = [drivers] if isinstance(drivers, SyncDriver) else list(drivers)
    usage: dict[str, list[tuple[float, int, int]]] = {}
    try:
        if len(fleet) == 1:
            for request in requests:
                fleet[0].submit(request)  # the driver holds each until its arrival
        else:
            for request in sorted(requests, key=lambda r: r.arrival):
                for driver in fleet:
                    while driver.clock.now() < request.arrival and _step_sampling(driver, usage):
                        pass
                target = min(range(len(fleet)), key=lambda i: (fleet[i].open_requests, i))
                fleet[target].submit(request)
        for driver in fleet:
            while _step_sampling(driver, usage):
                pass
    finally:
        for driver in fleet:
            driver.close()  # the PRM worker thread, if overlapped checks started one
    by_id = {res.request_id: res for driver in fleet for res in driver.results}
    results = tuple(by_id[r.id] for r in requests)
    if len(fleet) == 1:
        timeline = tuple(fleet[0].timeline)
    else:
        timeline = _fleet_timeline([d.timeline for d in fleet])
    return RunRecord(
        method=method,
        n=n,
        rate=rate,
        summary=RunSummary.of(results, list(timeline), gold),
        results=results,
        timeline=timeline,
        # In the requests' order: the engine reports its prefixes as a set, whose order
        # follows the string hash's seed, and runs.jsonl must not differ run to run.
        request_usage={r.id: tuple(usage[r.id]) for r in requests if r.id in usage},
        kv_capacity=None if kv_capacity is None else kv_capacity * len(fleet),
        batch_size=fleet[0].scheduler.config.batch_size * len(fleet),
        prm_busy=sum(d.prm_busy for d in fleet),
        prm_wait=sum(d.prm_wait for d in fleet),
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
        assert config.workload  # BenchConfig requires one without a trace
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


__all__ = [
    "PRM_COSTS",
    "PRM_GPUS",
    "PRM_PLACEMENTS",
    "BenchConfig",
    "RunRecord",
    "method_policy",
    "method_scoring",
    "plan",
    "run_bench",
    "run_method",
    "serve",
    "traces",
]
