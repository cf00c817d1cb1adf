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
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import attrs

from sart.bench.runner import METHODS, BenchConfig, RunRecord, run_method
from sart.bench.traces import Trace, TraceRequest
from sart.errors import ConfigError
from sart.metrics import Distribution, is_correct


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
        if method not in METHODS:
            raise ConfigError(f"mix={spec!r}: method {method!r} must be one of {sorted(METHODS)}")
        if klass.share <= 0 or klass.n < 1:
            raise ConfigError(f"mix={spec!r}: in {part!r}, SHARE must be > 0 and N >= 1")
        classes.append(klass)
    if len({c.name for c in classes}) != len(classes):
        raise ConfigError(f"mix={spec!r}: class names must differ")
    return tuple(classes)


def classes_of(trace: Trace, classes: Sequence[MixClass], seed: int) -> dict[str, int]:
    """Each request's class index, drawn from the shares (its own stream per request)."""
    total = sum(c.share for c in classes)
    weights = [c.share / total for c in classes]
    return {
        r.id: random.Random(f"mix/{seed}/{i}").choices(range(len(classes)), weights)[0]
        for i, r in enumerate(trace)
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


def run_mix(
    trace: Trace,
    classes: Sequence[MixClass],
    config: BenchConfig,
    rate: float | None,
    *,
    priorities: bool,
) -> MixRun:
    """Serve the mixed workload on ``trace`` (see the module docstring)."""
    of = classes_of(trace, classes, config.seed)
    policies = [METHODS[c.method](c.n, config.interval) for c in classes]

    def per_request(r: TraceRequest) -> dict[str, Any]:
        k = of[r.id]
        return {"policy": policies[k], "priority": k if priorities else 0}

    width = max(c.n for c in classes)
    record = run_method(trace, "sart", width, config, rate, per_request=per_request)
    gold = trace.gold()
    span = max(
        (r.timings.finished for r in record.results),
        default=0.0,
    ) - min((r.arrival for r in trace), default=0.0)
    stats = []
    for k, klass in enumerate(classes):
        mine = [r for r in record.results if of[r.request_id] == k]
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
    return MixRun("priority" if priorities else "fcfs", record, tuple(stats))


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
            }
            for run in runs
        ],
    }
