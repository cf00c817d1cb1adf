"""Priorities (``Request(priority=...)``): admission by urgency, then arrival; aging.

One priority for every request is Algorithm 1's first come, first served: the
rest of the suite (exact traces, the stateful tests) runs that path. Here,
several priorities on the fake engine.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import sart
from sart.testing import BranchScript, FakeEngine


def serve(requests: list[sart.Request], batch_size: int, aging: float | None = None):
    engine = FakeEngine(lambda branch: BranchScript(length=5))
    driver = sart.SyncDriver(engine, None, batch_size=batch_size, aging=aging)
    return {r.request_id: r for r in driver.run(requests)}, engine


def request(rid: str, arrival: float, priority: int, n: int = 1) -> sart.Request:
    policy = sart.vanilla() if n == 1 else sart.self_consistency(n)
    return sart.Request(rid, "p", policy, arrival=arrival, priority=priority)


def test_an_urgent_request_goes_before_bulk_ones_that_wait() -> None:
    bulk = [request(f"b{i}", 0.0, priority=1, n=2) for i in range(4)]
    urgent = request("u", 1.0, priority=0, n=2)
    results, _ = serve([*bulk, urgent], batch_size=2)
    assert all(r.ok for r in results.values())
    # b0 runs first (alone at t=0); when it ends, u (arrived at t=1) beats b1..b3.
    order = sorted(results, key=lambda rid: (results[rid].timings.scheduled, rid))
    assert order == ["b0", "u", "b1", "b2", "b3"]


@settings(max_examples=60)
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 2), st.integers(1, 3)),
        min_size=1,
        max_size=12,
    ),
    batch_size=st.integers(1, 4),
)
def test_strict_priorities_never_admit_a_less_urgent_request_first(specs, batch_size) -> None:
    requests = [request(f"r{i}", a, p, n) for i, (a, p, n) in enumerate(specs)]
    results, engine = serve(requests, batch_size)
    assert sorted(results) == sorted(r.id for r in requests)  # each ends exactly once
    assert all(r.ok for r in results.values())
    assert engine.peak_live <= batch_size and not engine.stats().live_branches
    for a in requests:
        for b in requests:
            sa, sb = results[a.id].timings.scheduled, results[b.id].timings.scheduled
            # a was waiting (arrived) when b was admitted, and is more urgent.
            if a.priority < b.priority and a.arrival < sb:
                assert sa <= sb, (a, b)


def test_aging_bounds_the_wait_of_a_less_urgent_request() -> None:
    # One slot; a bulk request at t=0, then an urgent one every step for 200 steps:
    # strictly, the bulk request waits for all of them; with aging=10 it goes before
    # every urgent request that arrived more than 10 after it.
    bulk = request("bulk", 0.0, priority=1)
    urgent = [request(f"u{t}", float(t), priority=0) for t in range(200)]
    strict, _ = serve([bulk, *urgent], batch_size=1)
    aged, _ = serve([bulk, *urgent], batch_size=1, aging=10.0)
    assert strict["bulk"].timings.scheduled > max(strict[u.id].timings.scheduled for u in urgent)
    when = aged["bulk"].timings.scheduled
    assert when < strict["bulk"].timings.scheduled / 5
    late = [u for u in urgent if u.arrival > 10.0]
    assert all(aged[u.id].timings.scheduled >= when for u in late)


def test_a_priority_must_be_an_int() -> None:
    import pytest

    with pytest.raises(sart.ConfigError, match=r"priority=1\.5 must be an int"):
        sart.Request("r", "p", sart.vanilla(), priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(sart.ConfigError, match="aging=0 must be None or > 0"):
        sart.SchedulerConfig(batch_size=1, aging=0)
