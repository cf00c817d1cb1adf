"""Serving metrics: latency percentiles, accuracy, tokens and memory of a run (pure).

Percentiles use the nearest-rank definition, which is the paper's ("P97
latency corresponds to the maximum latency within which 97% of the requests
are served"): the P-th percentile of ``n`` values is the smallest value such
that at least P% of the values are less than or equal to it, i.e. the
``ceil(P/100 * n)``-th smallest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs

from sart.driver import TimelineSample
from sart.results import RequestResult

PERCENTILES = (50, 90, 97, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``nan`` for no values)."""
    if not values:
        return math.nan
    if not 0 < p <= 100:
        raise ValueError(f"p={p!r} must be in (0, 100]")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


@attrs.frozen
class Distribution:
    """P50/P90/P97/P99, mean and max of a set of values."""

    p50: float
    p90: float
    p97: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(*([math.nan] * 6))
        p50, p90, p97, p99 = (percentile(values, p) for p in PERCENTILES)
        return cls(p50, p90, p97, p99, sum(values) / len(values), max(values))


Z95 = 1.959963984540054
"""The two-sided 95% quantile of the standard normal."""


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``correct / total`` (``(0, 1)`` when ``total`` is 0)."""
    if total <= 0:
        return (0.0, 1.0)
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    # Exact at the edges (the formula gives 0 and 1 there, up to rounding).
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == total else min(1.0, centre + half)
    return (low, high)


def is_correct(result: RequestResult, gold: str | None) -> bool:
    """A request is correct when it completed and its answer equals the gold one."""
    return gold is not None and result.ok and result.answer == gold


@attrs.frozen
class RunSummary:
    """The headline numbers of one run."""

    requests: int
    failed: int
    """Requests that failed: counted here, left out of the latency distributions
    (a failed request's latency measures its failure, not the method)."""
    accuracy: float | None
    """Fraction of requests answered correctly, failed ones included as wrong
    (``None`` without gold answers)."""
    e2e: Distribution
    queueing: Distribution
    inference: Distribution
    tokens_per_request: float
    """Mean tokens generated per request, all branches together."""
    peak_running_branches: int
    peak_kv_tokens: int
    makespan: float
    """Last finish time (the run's clock)."""
    prm_wait: Distribution
    """Per request: time its running branches stood still waiting for the PRM."""
    accuracy_interval: tuple[float, float] | None = None
    """The 95% Wilson interval of ``accuracy`` (``None`` without gold answers): on a
    few hundred requests, a few points of accuracy are within noise."""

    @classmethod
    def of(
        cls,
        results: Sequence[RequestResult],
        timeline: Sequence[TimelineSample] = (),
        gold: Mapping[str, str] | None = None,
    ) -> RunSummary:
        timings = [r.timings for r in results]
        served = [r for r in results if r.ok]
        latencies = [r.timings for r in served]
        accuracy = interval = None
        if gold is not None and results:
            correct = sum(is_correct(r, gold.get(r.request_id)) for r in results)
            accuracy = correct / len(results)
            interval = wilson_interval(correct, len(results))
        return cls(
            requests=len(results),
            failed=sum(1 for r in results if not r.ok),
            accuracy=accuracy,
            e2e=Distribution.of([t.end_to_end for t in latencies]),
            queueing=Distribution.of([t.queueing for t in latencies]),
            inference=Distribution.of([t.inference for t in latencies]),
            tokens_per_request=(
                sum(r.generated_tokens for r in results) / len(results) if results else 0.0
            ),
            peak_running_branches=max((s.running_branches for s in timeline), default=0),
            peak_kv_tokens=max((s.kv_tokens for s in timeline), default=0),
            makespan=max((t.finished for t in timings), default=0.0),
            prm_wait=Distribution.of([r.prm_wait_seconds for r in served]),
            accuracy_interval=interval,
        )


def slo_attainment(results: Sequence[RequestResult], slo: float) -> float:
    """The fraction of requests answered within ``slo`` of their arrival (end to end);
    a failed request misses it. 0.0 for no requests."""
    if not results:
        return 0.0
    met = sum(1 for r in results if r.ok and r.timings.end_to_end <= slo)
    return met / len(results)


def request_record(result: RequestResult, gold: str | None = None) -> dict:
    """One request as plain data (for JSON reports)."""
    t = result.timings
    return {
        "id": result.request_id,
        "status": result.status.value,
        "reason": result.reason,
        "arrival": t.arrival,
        "queueing": t.queueing,
        "inference": t.inference,
        "e2e": t.end_to_end,
        "answer": result.answer,
        "gold": gold,
        "correct": is_correct(result, gold) if gold is not None else None,
        "chosen": result.chosen,
        "prm_items": result.prm_items,
        "prm_seconds": result.prm_seconds,
        "prm_wait_seconds": result.prm_wait_seconds,
        "branches": [
            {
                "status": b.status.name.lower(),
                "tokens": b.num_tokens,
                "reward": b.reward,
                "answer": b.answer,
            }
            for b in result.branches
        ],
    }
