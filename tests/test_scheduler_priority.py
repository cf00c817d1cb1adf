"""Priorities (``Request(priority=...)``): admission by urgency, then arrival; aging.

One priority for every request is Algorithm 1's first come, first served: the
rest of the suite (exact traces, the stateful tests) runs that path. Here,
several priorities on the fake engine.
"""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

import sart
from sart.testing import BranchScript, FakeEngine, ScriptedPRM


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


# ------------------------------------------------------------------ pausing


def _scripts(lengths: dict[str, list[int]]):
    return {rid: [BranchScript(length=n) for n in ns] for rid, ns in lengths.items()}


workload_specs = st.lists(
    st.tuples(
        st.integers(0, 30),  # arrival
        st.integers(0, 2),  # priority
        st.lists(st.integers(1, 30), min_size=1, max_size=4),  # branch lengths
        st.sampled_from(["sc", "sart"]),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(
    specs=workload_specs,
    batch_size=st.integers(1, 6),
    scoring=st.sampled_from(["blocking", "overlapped"]),
    admission=st.sampled_from(["chunk", "token"]),
    aging=st.none() | st.sampled_from([5.0, 20.0]),
    interval=st.integers(1, 8),
)
def test_pausing_keeps_every_invariant_and_loses_no_token(
    specs, batch_size, scoring, admission, aging, interval
) -> None:
    from hypothesis import event

    requests, lengths = [], {}
    for i, (arrival, priority, ns, kind) in enumerate(specs):
        policy = (
            sart.self_consistency(len(ns), interval)
            if kind == "sc"
            else sart.sart(len(ns), interval=interval)
        )
        requests.append(sart.Request(f"r{i}", "p", policy, arrival=arrival, priority=priority))
        lengths[f"r{i}"] = ns
    scripts = _scripts(lengths)
    engine = FakeEngine(scripts)
    driver = sart.SyncDriver(
        engine,
        ScriptedPRM(scripts, every=interval),
        batch_size=batch_size,
        scoring=scoring,
        admission=admission,
        aging=aging,
    )
    for r in requests:
        driver.submit(r)
    seen = 0
    while driver.step():
        calls, seen = engine.log[seen:], len(engine.log)
        # Pausing never frees more than it must: the slots a pause frees go, in the same
        # batch, to other branches (the more urgent work it was made for).
        for at, call in enumerate(calls):
            if call[0] != "pause":
                continue
            paused = set(call[1])
            later = [
                sart.BranchId(c[1], j) for c in calls[at + 1 :] if c[0] == "start" for j in c[2]
            ]
            assert len(later) >= len(paused) and not paused & set(later)
            # Never a request's last running branch, never a more urgent request's.
            for bid in paused:
                assert any(b.request_id == bid.request_id for b in engine.live_branches)
    stats = driver.scheduler.statistics()
    event(f"paused: {'yes' if stats.paused_branches else 'no'}")
    results = {r.request_id: r for r in driver.results}
    assert sorted(results) == sorted(r.id for r in requests)  # each ends exactly once
    assert all(r.ok for r in results.values()), [r.reason for r in results.values()]
    assert engine.peak_live <= batch_size and not engine.stats().live_branches
    assert not engine.prefixes
    for rid, result in results.items():
        for b in result.branches:
            if b.status.is_completed:  # paused or not, it made exactly its script's tokens
                assert b.num_tokens == lengths[rid][b.index]
        chosen = scripts[rid][result.chosen]
        assert result.text == chosen.text_span(0, chosen.length)
    if aging is not None:
        # The bound aging gives: a request d levels less urgent than another is admitted
        # no later than it if it arrived at least d * aging before it.
        for a in requests:
            for b in requests:
                d = a.priority - b.priority
                if d > 0 and b.arrival - a.arrival >= d * aging:
                    sa, sb = results[a.id].timings.scheduled, results[b.id].timings.scheduled
                    assert sa <= sb, (a.id, b.id)


def test_a_paused_branch_resumes_where_it_stopped() -> None:
    bulk = sart.Request("bulk", "p", sart.self_consistency(4, interval=5), priority=1)
    urgent = sart.Request("urgent", "p", sart.vanilla(interval=5), arrival=3, priority=0)
    scripts = _scripts({"bulk": [40, 40, 40, 40], "urgent": [10]})
    engine = FakeEngine(scripts)
    results = {r.request_id: r for r in sart.run([bulk, urgent], engine, batch_size=4)}
    pauses = [call for call in engine.log if call[0] == "pause"]
    # One slot for the urgent request's one branch: one bulk branch paused, once.
    assert pauses == [("pause", (sart.BranchId("bulk", 3),))]
    assert [b.num_tokens for b in results["bulk"].branches] == [40] * 4
    assert results["urgent"].timings.end_to_end <= 10 + 5  # its tokens, plus one chunk
    # The default rule pauses the highest index among equal (unscored, as long) branches.


def test_pausing_is_off_for_engines_that_cannot() -> None:
    class NoPause(FakeEngine):
        supports_pause = False

    bulk = sart.Request("bulk", "p", sart.self_consistency(4, interval=5), priority=1)
    urgent = sart.Request("urgent", "p", sart.vanilla(interval=5), arrival=3, priority=0)
    engine = NoPause(_scripts({"bulk": [40] * 4, "urgent": [10]}))
    results = {r.request_id: r for r in sart.run([bulk, urgent], engine, batch_size=4)}
    assert not [call for call in engine.log if call[0] == "pause"]
    assert results["urgent"].timings.end_to_end > 30  # it waited for a bulk branch to end


def test_a_pause_rule_picks_the_branches() -> None:
    class Lowest(sart.PauseRule):
        def choose(self, request):  # type: ignore[no-untyped-def]
            return [0, 1, 2, 3]

    bulk = sart.Request(
        "bulk", "p", attrs.evolve(sart.self_consistency(4, interval=5), pause=Lowest()), priority=1
    )
    urgent = sart.Request("urgent", "p", sart.self_consistency(2, interval=5), arrival=3)
    engine = FakeEngine(_scripts({"bulk": [40] * 4, "urgent": [10, 10]}))
    sart.run([bulk, urgent], engine, batch_size=4)
    pauses = [call for call in engine.log if call[0] == "pause"]
    assert pauses == [("pause", (sart.BranchId("bulk", 0), sart.BranchId("bulk", 1)))]


def test_a_failing_pause_fails_the_paused_request_and_frees_its_branches() -> None:
    bulk = sart.Request("bulk", "p", sart.self_consistency(4, interval=5), priority=1)
    other = sart.Request("other", "p", sart.self_consistency(2, interval=5), priority=1)
    urgent = sart.Request("urgent", "p", sart.vanilla(interval=5), arrival=3, priority=0)
    scripts = _scripts({"bulk": [40] * 4, "other": [40, 40], "urgent": [10]})
    engine = FakeEngine(scripts, fail_pause={"bulk"})
    results = {r.request_id: r for r in sart.run([bulk, other, urgent], engine, batch_size=6)}
    assert results["bulk"].status is sart.RequestStatus.FAILED
    assert "pausing branches failed" in (results["bulk"].reason or "")
    assert results["urgent"].ok and results["other"].ok  # the others carry on
    assert not engine.stats().live_branches and not engine.prefixes
