"""Mixed workloads: classes of requests with their own method, ``N`` and priority.

``sart bench --mix interactive:0.2:sart:2,bulk:0.8:sc:8`` serves one workload
whose requests are split into classes — each ``NAME:SHARE:METHOD:N``, the
first the most urgent — twice on the same trace: first come, first served
(every request priority 0, Algorithm 1) and by priority (class ``k`` has
priority ``k``). Each request's class is drawn from the shares with its own
random stream (the seed and its index), so both runs, and runs at other
rates, see the same classes. It reports, per class and run, P50/P97
end-to-end latency, accuracy, and throughput (completed requests per second of
the run), so the cost of urgency to the bulk class shows.

On the simulator (``run_mix``) the workload is a generated trace; on a real
engine (``run_mix_real``: ``sart bench --engine hf|vllm|sglang --mix ...``)
it is the run's prompts (testbed questions by default) arriving as a Poisson
stream, served on one loaded engine and PRM, FCFS then by priority.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from sart.bench.runner import BenchConfig, RunRecord, method_policy, run_method
from sart.bench.traces import Trace, TraceRequest
from sart.errors import ConfigError
from sart.methods import method_names
from sart.metrics import Distribution, is_correct
from sart.results import RequestResult

if TYPE_CHECKING:
    from sart.bench.real import PromptItem
    from sart.engines.base import Engine
    from sart.policies.equivalence import Equivalence
    from sart.prm.base import PRM
    from sart.types import SamplingSettings


@attrs.frozen
class MixClass:
    """One class of a mixed workload."""

    name: str
    share: float
    method: str
    n: int


def parse_mix(spec: str) -> tuple[MixClass, ...]:
    """``"interactive:0.2:sart:2,bulk:0.8:sc:8"`` -> classes, most urgent first."""
    classes = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        if len(fields) != 4:
            raise ConfigError(f"mix={spec!r}: {part!r} must be NAME:SHARE:METHOD:N")
        name, share, method, n = fields
        try:
            klass = MixClass(name, float(share), method, int(n))
        except ValueError:
            raise ConfigError(
                f"mix={spec!r}: in {part!r}, SHARE must be a number, N an int"
            ) from None
        if method not in method_names():
            raise ConfigError(f"mix={spec!r}: method {method!r} must be one of {method_names()}")
        if klass.share <= 0 or klass.n < 1:
            raise ConfigError(f"mix={spec!r}: in {part!r}, SHARE must be > 0 and N >= 1")
        classes.append(klass)
    if len({c.name for c in classes}) != len(classes):
        raise ConfigError(f"mix={spec!r}: class names must differ")
    return tuple(classes)


def classes_of(ids: Iterable[str], classes: Sequence[MixClass], seed: int) -> dict[str, int]:
    """Each request's class index, drawn from the shares (its own stream per request)."""
    total = sum(c.share for c in classes)
    weights = [c.share / total for c in classes]
    return {
        rid: random.Random(f"mix/{seed}/{i}").choices(range(len(classes)), weights)[0]
        for i, rid in enumerate(ids)
    }


@attrs.frozen
class ClassStats:
    name: str
    requests: int
    e2e: Distribution
    accuracy: float | None
    throughput: float
    """Completed requests of the class per unit of time, over the whole run."""


@attrs.frozen
class MixRun:
    """One run of a mixed workload: FCFS or by priority."""

    scheduling: str
    record: RunRecord
    classes: tuple[ClassStats, ...]
    paused: int | None = None
    """Branches paused for more urgent ones (real engines; ``None`` where not counted)."""


def run_mix(
    trace: Trace,
    classes: Sequence[MixClass],
    config: BenchConfig,
    rate: float | None,
    *,
    priorities: bool,
) -> MixRun:
    """Serve the mixed workload on ``trace`` (see the module docstring)."""
    of = classes_of([r.id for r in trace], classes, config.seed)
    policies = [method_policy(c.method, c.n, config.interval) for c in classes]

    def per_request(r: TraceRequest) -> dict[str, Any]:
        k = of[r.id]
        return {"policy": policies[k], "priority": k if priorities else 0}

    width = max(c.n for c in classes)
    record = run_method(trace, "sart", width, config, rate, per_request=per_request)
    start = min((r.arrival for r in trace), default=0.0)
    stats = class_stats(record.results, classes, of, trace.gold(), start)
    return MixRun("priority" if priorities else "fcfs", record, stats)


def run_mix_real(
    items: Sequence[PromptItem],
    classes: Sequence[MixClass],
    engine: Engine,
    prm: PRM | None,
    config: BenchConfig,
    sampling: SamplingSettings,
    rate: float | None,
    *,
    priorities: bool,
    equivalence: Equivalence | None = None,
) -> MixRun:
    """Serve ``items`` as a mixed workload on a real engine (see the module docstring):
    arrivals drawn from ``rate`` and the seed, so the FCFS and the priority run of a
    rate see the same stream and the same classes; the classes' votes group answers
    under ``equivalence`` (``None``: exact strings)."""
    from sart.bench.real import arrivals, real_driver
    from sart.bench.runner import serve
    from sart.request import Request

    of = classes_of([item.id for item in items], classes, config.seed)
    policies = [
        method_policy(c.method, c.n, config.interval, equivalence=equivalence) for c in classes
    ]
    times = [0.0] * len(items) if rate is None else arrivals(len(items), rate, config.seed)
    requests = [
        Request(
            item.id,
            item.prompt,
            policies[of[item.id]],
            sampling=sampling,
            arrival=t,
            priority=of[item.id] if priorities else 0,
        )
        for item, t in zip(items, times)
    ]
    driver = real_driver(engine, prm, config, "sart")
    gold = {item.id: item.answer for item in items if item.answer is not None}
    record = serve(driver, requests, gold, "mix", max(c.n for c in classes), rate)
    stats = class_stats(record.results, classes, of, gold, 0.0)
    paused = driver.scheduler.statistics().paused_branches
    return MixRun("priority" if priorities else "fcfs", record, stats, paused)


def class_stats(
    results: Sequence[RequestResult],
    classes: Sequence[MixClass],
    of: dict[str, int],
    gold: dict[str, str],
    start: float,
) -> tuple[ClassStats, ...]:
    """Per class: latency, accuracy, and throughput over the run (from ``start``, the
    first arrival, to the last finish)."""
    span = max((r.timings.finished for r in results), default=0.0) - start
    stats = []
    for k, klass in enumerate(classes):
        mine = [r for r in results if of[r.request_id] == k]
        done = [r for r in mine if r.ok]
        correct = [is_correct(r, gold.get(r.request_id)) for r in done]
        stats.append(
            ClassStats(
                name=klass.name,
                requests=len(mine),
                e2e=Distribution.of([r.timings.end_to_end for r in done]),
                accuracy=sum(correct) / len(correct) if correct else None,
                throughput=len(done) / span if span > 0 else float("nan"),
            )
        )
    return tuple(stats)


def mix_json(runs: Sequence[MixRun], classes: Sequence[MixClass], rate: float | None) -> dict:
    return {
        "rate": rate,
        "classes": [attrs.asdict(c) | {"priority": k} for k, c in enumerate(classes)],
        "runs": [
            {
                "scheduling": run.scheduling,
                "classes": [
                    {
                        "name": s.name,
                        "requests": s.requests,
                        "p50": s.e2e.p50,
                        "p97": s.e2e.p97,
                        "accuracy": s.accuracy,
                        "throughput": s.throughput,
                    }
                    for s in run.classes
                ],
                "preemptions": run.record.preemptions,
                "paused_branches": run.paused,
            }
            for run in runs
        ],
    }
