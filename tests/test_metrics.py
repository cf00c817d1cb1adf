"""Serving metrics (``sart.metrics``): nearest-rank percentiles and run summaries, by hand."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.driver import TimelineSample
from sart.metrics import (
    Distribution,
    RunSummary,
    is_correct,
    percentile,
    request_record,
    slo_attainment,
    wilson_interval,
)
from sart.results import BranchOutcome, RequestResult, Timings
from sart.types import BranchStatus, Phase, RequestStatus


def outcome(index: int, tokens: int, status: BranchStatus = BranchStatus.FINISHED) -> BranchOutcome:
    completed = status.is_completed
    return BranchOutcome(
        index=index,
        status=status,
        num_tokens=tokens,
        reward=0.5 if completed else None,
        answer="x" if completed else None,
        ended_in=Phase.EXPLOIT,
    )


def completed(
    rid: str, answer: str, arrival: float, scheduled: float, finished: float, tokens: list[int]
) -> RequestResult:
    return RequestResult(
        request_id=rid,
        status=RequestStatus.COMPLETED,
        chosen=0,
        text=f"\\boxed{{{answer}}}",
        answer=answer,
        branches=tuple(outcome(j, n) for j, n in enumerate(tokens)),
        timings=Timings(arrival=arrival, scheduled=scheduled, finished=finished),
    )


def failed(rid: str, arrival: float, finished: float, tokens: list[int]) -> RequestResult:
    """A request that failed before it was ever scheduled (prefill refused)."""
    return RequestResult(
        request_id=rid,
        status=RequestStatus.FAILED,
        chosen=None,
        text=None,
        answer=None,
        branches=tuple(outcome(j, n, BranchStatus.FAILED) for j, n in enumerate(tokens)),
        timings=Timings(arrival=arrival, scheduled=None, finished=finished),
        reason="boom",
    )


# ------------------------------------------------------------------ percentiles


def test_nearest_rank_on_one_to_hundred() -> None:
    values = list(range(100, 0, -1))  # order does not matter
    assert percentile(values, 50) == 50
    assert percentile(values, 90) == 90
    assert percentile(values, 97) == 97
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile(values, 0.5) == 1
    assert percentile(values, 97.5) == 98  # ceil(97.5) = 98th smallest


def test_nearest_rank_small_samples() -> None:
    assert percentile([5, 1, 3], 50) == 3  # ceil(1.5) = 2nd smallest
    assert percentile([5, 1, 3], 34) == 3  # ceil(1.02) = 2nd
    assert percentile([5, 1, 3], 33) == 1  # ceil(0.99) = 1st
    assert percentile([5, 1, 3], 99) == 5
    assert percentile([4.0, 2.0], 50) == 2.0  # never interpolates
    assert percentile([7.5], 1) == 7.5
    assert percentile([7.5], 99) == 7.5


def test_percentile_of_nothing_is_nan_and_p_must_be_in_range() -> None:
    assert math.isnan(percentile([], 50))
    for p in (0, -1, 100.5):
        with pytest.raises(ValueError, match="p="):
            percentile([1.0, 2.0], p)


@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=50), st.floats(0.01, 100))
def test_percentile_is_the_smallest_value_covering_p_percent(values: list[int], p: float) -> None:
    q = percentile(values, p)
    assert q in values
    assert sum(v <= q for v in values) >= p / 100 * len(values)
    below = [v for v in values if v < q]
    if below:  # any smaller value covers less than p%
        assert sum(v <= max(below) for v in values) < p / 100 * len(values)


def test_distribution_of() -> None:
    d = Distribution.of([float(v) for v in range(1, 101)])
    assert (d.p50, d.p90, d.p97, d.p99) == (50.0, 90.0, 97.0, 99.0)
    assert d.mean == 50.5
    assert d.max == 100.0
    small = Distribution.of([4.0, 1.0, 10.0])
    assert (small.p50, small.p90, small.mean, small.max) == (4.0, 10.0, 5.0, 10.0)
    empty = Distribution.of([])
    assert all(math.isnan(v) for v in attrs_values(empty))


def attrs_values(d: Distribution) -> list[float]:
    return [d.p50, d.p90, d.p97, d.p99, d.mean, d.max]


# ------------------------------------------------------------------ run summaries


def test_run_summary_by_hand() -> None:
    results = [
        completed("a", "7", arrival=0.0, scheduled=0.0, finished=10.0, tokens=[10, 4]),
        completed("b", "3", arrival=2.0, scheduled=5.0, finished=25.0, tokens=[20, 6, 1]),
        failed("c", arrival=4.0, finished=9.0, tokens=[3]),
        completed("d", "1", arrival=6.0, scheduled=6.0, finished=12.0, tokens=[5]),
    ]
    timeline = [
        TimelineSample(5.0, running_branches=3, kv_tokens=100),
        TimelineSample(10.0, running_branches=6, kv_tokens=80),
        TimelineSample(20.0, running_branches=2, kv_tokens=250),
    ]
    gold = {"a": "7", "b": "4", "c": "9", "d": "1"}
    s = RunSummary.of(results, timeline, gold)
    assert (s.requests, s.failed) == (4, 1)
    assert s.accuracy == 0.5  # a and d; b is wrong; c failed, which counts as wrong
    assert s.accuracy_interval == wilson_interval(2, 4)  # of all 4, the failed one included
    # Latencies of the served requests only (c failed: counted in `failed`, not timed;
    # before, its 5 s moved every percentile). End to end: 10, 23, 6. Queueing: 0, 3, 0.
    # Inference: 10, 20, 6.
    assert (s.e2e.p50, s.e2e.max, s.e2e.mean) == (10.0, 23.0, 13.0)
    assert (s.queueing.p50, s.queueing.max, s.queueing.mean) == (0.0, 3.0, 1.0)
    assert (s.inference.p50, s.inference.p99, s.inference.mean) == (10.0, 20.0, 12.0)
    assert s.tokens_per_request == (14 + 27 + 3 + 5) / 4
    assert s.peak_running_branches == 6  # peaks of different samples
    assert s.peak_kv_tokens == 250
    assert s.makespan == 25.0
    assert s.prm_wait.max == 0.0  # results that never waited for a PRM


def test_run_summary_of_prm_waits() -> None:
    results = [
        attrs.evolve(completed(rid, "7", 0.0, 0.0, 9.0, [3]), prm_wait_seconds=wait)
        for rid, wait in (("a", 1.0), ("b", 0.0), ("c", 5.0))
    ]
    s = RunSummary.of(results)
    assert (s.prm_wait.mean, s.prm_wait.p50, s.prm_wait.p97) == (2.0, 1.0, 5.0)


def test_run_summary_without_gold_or_timeline() -> None:
    s = RunSummary.of([completed("a", "7", 1.0, 1.0, 3.0, [2])])
    assert s.accuracy is None and s.accuracy_interval is None
    assert (s.peak_running_branches, s.peak_kv_tokens) == (0, 0)
    assert s.makespan == 3.0
    # Gold answers that do not name a request make it wrong, not an error.
    assert RunSummary.of([completed("a", "7", 1.0, 1.0, 3.0, [2])], gold={}).accuracy == 0.0


def test_run_summary_of_nothing() -> None:
    s = RunSummary.of([], gold={"a": "1"})
    assert (s.requests, s.failed, s.accuracy) == (0, 0, None)
    assert s.tokens_per_request == 0.0
    assert s.makespan == 0.0
    assert math.isnan(s.e2e.p50)


def test_is_correct() -> None:
    ok = completed("a", "7", 0.0, 0.0, 1.0, [1])
    assert is_correct(ok, "7")
    assert not is_correct(ok, "8")
    assert not is_correct(ok, None)
    assert not is_correct(failed("b", 0.0, 1.0, [1]), "7")


def test_request_record() -> None:
    record = request_record(
        completed("b", "3", arrival=2.0, scheduled=5.0, finished=25.0, tokens=[20, 6]), gold="3"
    )
    assert record["id"] == "b"
    assert record["status"] == "completed"
    assert (record["queueing"], record["inference"], record["e2e"]) == (3.0, 20.0, 23.0)
    assert record["correct"] is True
    assert [b["tokens"] for b in record["branches"]] == [20, 6]
    assert record["branches"][0]["status"] == "finished"
    assert (record["prm_seconds"], record["prm_wait_seconds"]) == (0.0, 0.0)
    assert request_record(failed("c", 0.0, 1.0, [1]))["correct"] is None


# ------------------------------------------------------------------ SLO attainment


def test_slo_attainment_counts_requests_answered_in_time_and_failed_ones_as_misses() -> None:
    results = [
        completed("a", "1", arrival=0.0, scheduled=0.0, finished=5.0, tokens=[5]),
        completed("b", "1", arrival=2.0, scheduled=4.0, finished=12.0, tokens=[8]),  # 10
        completed("c", "1", arrival=1.0, scheduled=1.0, finished=12.5, tokens=[9]),  # 11.5
        failed("d", arrival=0.0, finished=1.0, tokens=[0]),  # quick, but no answer
    ]
    assert slo_attainment(results, 10.0) == 0.5  # a and b: the bound is inclusive
    assert slo_attainment(results, 4.0) == 0.0
    assert slo_attainment(results, 100.0) == 0.75
    assert slo_attainment([], 10.0) == 0.0
