"""Re-branching (``sart.policies.rebranch``) and particle filtering on the scheduler:
how forks are shared out, when a rule forks at all, and whole runs on the fake engine
(a property test over drawn forking policies, and worked examples)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import sart
from sart.engines.costs import CostModel
from sart.engines.sim import SimEngine
from sart.policies.rebranch import largest_remainder, parent_weights, systematic, top_first
from sart.testing import BranchScript, FakeEngine, ScriptedPRM, ScriptTable
from sart.types import BranchStatus, Phase
from sart.views import BranchView, Limits, Load, RequestView
from strategies import (
    CPU_LIKE,
    MAX_BATCH,
    branch_scripts,
    examples,
    forking_policies,
    intervals,
)

S = BranchStatus


def branch(index: int, reward: float | None, status: S = S.RUNNING, tokens: int = 10) -> BranchView:
    return BranchView(
        index=index, status=status, num_tokens=tokens, reward=reward, text="", end_step=None
    )


def request(
    *branches: BranchView,
    n: int | None = None,
    completed: int = 0,
    load: Load | None = None,
    max_tokens: int | None = 100,
) -> RequestView:
    return RequestView(
        request_id="q",
        n=len(branches) if n is None else n,
        phase=Phase.EXPLORE,
        limits=Limits(threshold=0.5, max_num_pruned=1),
        num_completed=completed,
        num_pruned=0,
        branches=branches,
        load=load,
        max_tokens=max_tokens,
    )


def load(waiting_requests: int = 0, waiting_branches: int = 0, kv: int | None = None) -> Load:
    return Load(
        waiting_requests=waiting_requests,
        waiting_branches=waiting_branches,
        running_branches=4,
        budget=8,
        active_requests=1,
        arrival_rate=None,
        waited=0.0,
        kv_tokens=kv,
        kv_capacity=100 if kv is not None else None,
    )


# ---------------------------------------------------------------- sharing out forks

weights_lists = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8)


@given(rewards=weights_lists, k=st.integers(0, 16), u=st.floats(0.0, 0.999))
def test_systematic_resampling_draws_k_within_floor_and_ceil_of_each_expectation(
    rewards: list[float], k: int, u: float
) -> None:
    parents = [branch(i, r) for i, r in enumerate(rewards)]
    weights = parent_weights(parents, None)
    shares = systematic(parents, weights, k, u)
    assert sum(shares.values()) == k
    total = sum(weights)
    for b, w in zip(parents, weights):
        expected = k * w / total
        assert expected - 1 - 1e-9 <= shares[b.index] <= expected + 1 + 1e-9


@given(rewards=weights_lists, k=st.integers(0, 16))
def test_largest_remainder_and_top_first_share_exactly_k(rewards: list[float], k: int) -> None:
    parents = [branch(i, r) for i, r in enumerate(rewards)]
    assert sum(largest_remainder(parents, parent_weights(parents, 0.2), k).values()) == k
    shares = top_first(parents, k)
    assert sum(shares.values()) == k
    best = max(parents, key=lambda b: (b.reward, -b.index))
    assert shares[best.index] == max(shares.values())


def test_softmax_concentrates_on_the_best_parent_and_zero_rewards_weigh_equally() -> None:
    parents = [branch(0, 0.9), branch(1, 0.2)]
    assert largest_remainder(parents, parent_weights(parents, 0.05), 3) == {0: 3, 1: 0}
    zeros = [branch(0, 0.0), branch(1, 0.0)]
    assert parent_weights(zeros, None) == [1.0, 1.0]


# ---------------------------------------------------------------- when a rule forks


def test_only_the_seats_pruning_freed_unless_completed_seats_are_refilled() -> None:
    # n = 4: two running, one completed, one pruned -> one seat pruning freed.
    view = request(
        branch(0, 0.9),
        branch(1, 0.3),
        branch(2, 0.8, S.FINISHED),
        branch(3, 0.1, S.PRUNED),
        completed=1,
    )
    assert sart.Rebranch().fork(view, room=2) == {0: 1}
    assert sum(sart.Rebranch(refill_completed=True).fork(view, room=2).values()) == 2
    assert sart.Rebranch().fork(view, room=0) == {}


def test_no_parent_past_until_nor_unscored_nor_nan() -> None:
    view = request(
        branch(0, 0.9, tokens=60),
        branch(1, None),
        branch(2, float("nan")),
        branch(3, 0.1, S.PRUNED),
        max_tokens=100,
    )
    assert sart.Rebranch(until=0.5).fork(view, room=1) == {}
    assert sart.Rebranch(until=0.75).fork(view, room=1) == {0: 1}


def test_stop_after_and_token_budget_end_forking() -> None:
    view = request(
        branch(0, 0.9, tokens=40),
        branch(1, 0.8, S.FINISHED, tokens=40),
        branch(2, 0.1, S.PRUNED, tokens=20),
        completed=1,
    )
    assert sart.Rebranch().fork(view, room=1) == {0: 1}
    assert sart.Rebranch(stop_after=1).fork(view, room=1) == {}
    # 100 tokens generated so far.
    assert sart.Rebranch(token_budget=101).fork(view, room=1) == {0: 1}
    assert sart.Rebranch(token_budget=100).fork(view, room=1) == {}


def test_a_fork_inherits_tokens_that_count_once() -> None:
    child = attrs.evolve(branch(3, 0.9, tokens=40), parent=0, inherited=30)
    view = request(branch(0, 0.9, tokens=40), child, n=2)
    assert view.generated_tokens == 40 + 10


def test_under_load_it_forks_nothing() -> None:
    view = request(branch(0, 0.9), branch(1, 0.1, S.PRUNED), load=load())
    assert sart.Rebranch().fork(view, room=1) == {0: 1}
    for busy in (load(waiting_requests=1), load(waiting_branches=1), load(kv=95)):
        assert sart.Rebranch().fork(attrs.evolve(view, load=busy), room=1) == {}
        assert sart.Rebranch(when_idle=False).fork(attrs.evolve(view, load=busy), room=1)
    # Its own waiting branches are not someone else's work.
    own = request(
        branch(0, 0.9),
        branch(1, None, S.WAITING),
        branch(2, 0.1, S.PRUNED),
        load=load(waiting_branches=1),
    )
    assert sart.Rebranch().fork(own, room=1) == {0: 1}


def test_with_a_row_budget_it_forks_only_while_rows_are_cheap() -> None:
    view = request(branch(0, 0.9), branch(1, 0.1, S.PRUNED))
    rule = sart.Rebranch(row_budget=1.0)
    cheap, dear = costed(4, 0.002, 0.0004), costed(4, 0.002, 0.0006)
    assert rule.fork(attrs.evolve(view, load=cheap), room=1) == {0: 1}
    assert rule.fork(attrs.evolve(view, load=dear), room=1) == {}
    assert sart.Rebranch().fork(attrs.evolve(view, load=dear), room=1) == {0: 1}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("parents", "best", "parents='best' must be one of"),
        ("temperature", 0.0, "temperature=0.0 must be > 0"),
        ("until", 0.0, "until=0.0 must be in (0, 1]"),
        ("stop_after", 0, "stop_after=0 must be >= 1 or None"),
        ("token_budget", -1, "token_budget=-1 must be >= 1 or None"),
        ("kv_limit", 1.5, "kv_limit=1.5 must be in (0, 1]"),
        ("row_budget", 0, "row_budget=0 must be None or a finite number > 0"),
    ],
)
def test_bad_options_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(sart.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sart.Rebranch(**{field: value})


def refilling(n: int, m: int, interval: int) -> sart.Policy:
    """SART with the stock seat-refilling rule."""
    return attrs.evolve(sart.sart(n, m=m, interval=interval), rebranch=sart.Rebranch())


def test_recipes_and_methods() -> None:
    policy = sart.sart_rebranch(8)
    assert policy.stop == sart.Agreement(4, k=2) and policy.select == sart.WeightedVote()
    assert sart.sart_rebranch(8, agree=None).stop == sart.FirstM(4)
    assert sart.sart_rebranch(8, agree=3).stop == sart.Agreement(4, k=3)
    assert sart.sart_rebranch(4).stop == sart.FirstM(2)  # k = m: the same stop
    assert policy.prune == sart.Reshare(sart.TwoPhasePrune(0.5, 4), temperature=0.2, row_budget=1.0)
    assert policy.forks and not policy.rescores
    assert refilling(8, 4, 400).rescores and refilling(8, 4, 400).forks
    assert not sart.sart(8).forks and not sart.sart(8).rescores
    particle = sart.particle_filter(4)
    assert particle.prune == sart.Resample() and particle.forks
    assert particle.select == sart.BestReward() and particle.stop == sart.AllDone()
    from sart.methods import get_method

    assert get_method("sart-rebranch").policy(8, 64, m=2).stop == sart.FirstM(2)
    assert get_method("particle").policy(4, 64).n == 4


# ---------------------------------------------------------------- whole runs


def run_one(policy: sart.Policy, scripts: list[BranchScript], **kwargs: object):
    table = ScriptTable({"q": scripts})
    engine = FakeEngine(table, max_branches=kwargs.pop("batch_size", 8))  # type: ignore[arg-type]
    prm = ScriptedPRM(table, every=policy.interval)
    (result,) = sart.run(
        [sart.Request("q", "p", policy)], engine, prm, batch_size=engine.max_branches, **kwargs
    )
    return result, engine


def test_a_pruned_seat_is_refilled_with_a_fork_of_the_best_branch() -> None:
    # n = 4, m = 2: at the check at 10 tokens branch 3 (0.1 < alpha) is pruned and its
    # seat goes to a fork of branch 0 (0.9): child 4 starts from 0's 10 tokens.
    scripts = [
        BranchScript(length=50, answer="7", rewards=(0.9,), final_reward=0.9),
        BranchScript(length=40, answer="3", rewards=(0.6,), final_reward=0.6),
        BranchScript(length=60, answer="3", rewards=(0.6,), final_reward=0.6),
        BranchScript(length=30, answer="3", rewards=(0.1,)),
    ]
    result, engine = run_one(refilling(4, 2, 10), scripts)
    assert ("start", "q", (4,)) in engine.log
    child = result.branches[4]
    assert (child.parent, child.inherited) == (0, 10)
    assert result.branches[3].status is S.PRUNED
    assert engine.peak_live == 4
    # The child follows its parent's script to 50 tokens: it and branch 1 (40) are the
    # first two to complete; the fork counted toward m when it finished, not before.
    assert child.status is S.FINISHED and child.num_tokens == 50
    assert result.num_completed == 3 and result.answer == "7"
    assert result.generated_tokens == 50 + 40 + 50 + 10 + 40
    plain, _ = run_one(sart.sart(4, m=2, interval=10), scripts)
    assert len(plain.branches) == 4 and plain.branches[3].status is S.PRUNED


def test_at_saturation_the_refilling_rule_forks_nothing() -> None:
    # One slot too few: the second request waits, so the first forks nothing.
    scripts = [
        BranchScript(length=30, answer="7", rewards=(0.9,), final_reward=0.9),
        BranchScript(length=30, answer="3", rewards=(0.1,)),
    ]
    table = ScriptTable({"a": scripts, "b": scripts})
    requests = [sart.Request(rid, "p", refilling(2, 1, 10), arrival=0.0) for rid in ("a", "b")]
    engine = FakeEngine(table, max_branches=3)
    results = sart.run(requests, engine, ScriptedPRM(table, every=10), batch_size=3)
    first = results[0]
    assert len(first.branches) == 2 and first.branches[1].status is S.PRUNED
    assert all(r.ok for r in results)


def _not_running(request: RequestView) -> int:
    return next(b.index for b in request.branches if not b.is_running)


@pytest.mark.parametrize(
    ("fork", "reason"),
    [
        (
            lambda r, room: {r.running[0].index: room + 1},
            "rebranch rule asked for 2 new branches; 1 may start now",
        ),
        (lambda r, room: [0], "returned [0], not a mapping of index to children"),
        (lambda r, room: None, "returned None, not a mapping"),
        (lambda r, room: {7: 1}, "chose 7, not a branch index"),
        (lambda r, room: {0: 0, "a": 1}, "chose 'a', not a branch index"),
        (lambda r, room: {True: 1}, "chose True, not a branch index"),
        (lambda r, room: {_not_running(r): 1}, "which is not running"),
        (lambda r, room: {r.running[0].index: -1}, "asked for -1 children of branch"),
        (lambda r, room: {r.running[0].index: 0.5}, "asked for 0.5 children of branch"),
        (lambda r, room: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_a_rule_that_asks_for_what_cannot_be_forked_fails_its_request_alone(
    fork: object, reason: str
) -> None:
    class Wrong(sart.RebranchRule):
        def fork(self, request: RequestView, room: int) -> Mapping[int, int]:
            return fork(request, room)  # type: ignore[operator,no-any-return]

    # n = 2, m = 1, beta = 1: the first check prunes one branch, and its seat is free.
    scripts = [BranchScript(length=30, rewards=(0.5,))] * 2
    bad = attrs.evolve(sart.sart(2, m=1, alpha=0.6, beta=1, interval=10), rebranch=Wrong())
    table = ScriptTable({"bad": scripts, "good": scripts})
    engine = FakeEngine(table)
    results = sart.run(
        [sart.Request("bad", "p", bad), sart.Request("good", "p", sart.sart(2, interval=10))],
        engine,
        ScriptedPRM(table, every=10),
        batch_size=8,
    )
    assert not results[0].ok
    assert reason in (results[0].reason or "")
    assert results[1].ok
    assert not engine.live_branches and not engine.prefixes


def test_particle_filtering_resamples_every_check() -> None:
    scripts = [
        BranchScript(length=40, answer="7", rewards=(0.95, 0.95), final_reward=0.95),
        BranchScript(length=40, answer="3", rewards=(0.05, 0.05)),
        BranchScript(length=40, answer="3", rewards=(0.05, 0.05)),
        BranchScript(length=40, answer="3", rewards=(0.05, 0.05)),
    ]
    result, engine = run_one(sart.particle_filter(4, interval=10), scripts)
    # Weights 0.95 / 0.05 x 3: systematic draws give branch 0 three or four of four.
    assert len(result.branches) > 4 and result.answer == "7"
    assert engine.peak_live == 4
    assert all(b.parent in (None, 0) for b in result.branches)


# ---------------------------------------------------------------- property


@st.composite
def forking_workloads(draw: st.DrawFn) -> tuple[list[sart.Request], dict, int]:
    interval = draw(intervals)
    requests, scripts = [], {}
    for i in range(draw(st.integers(1, 5))):
        policy = draw(forking_policies(interval))
        rid = f"r{i}"
        scripts[rid] = draw(st.lists(branch_scripts, min_size=policy.n, max_size=policy.n))
        max_tokens = draw(st.integers(1, 80))
        arrival = draw(st.integers(0, 30))
        sampling = sart.SamplingSettings(max_tokens=max_tokens)
        requests.append(sart.Request(rid, "p", policy, sampling, float(arrival)))
    return requests, scripts, draw(st.integers(1, MAX_BATCH))


def run_forking(
    requests: list[sart.Request],
    scripts: dict,
    batch: int,
    scoring: sart.Scoring,
    cost: CostModel | None = None,
):
    table = ScriptTable(scripts)
    if cost is None:
        engine = FakeEngine(table, max_branches=batch)
    else:  # a virtual clock: the scheduler's step-cost fit is deterministic
        engine = SimEngine(table, cost=cost, max_branches=batch)
    widths = {r.id: r.policy.n for r in requests}
    peaks: Counter[str] = Counter()

    original = engine.start_branches

    def start(request_id: str, branches: object) -> None:
        original(request_id, branches)  # type: ignore[arg-type]
        live = sum(b.request_id == request_id for b in engine.live_branches)
        peaks[request_id] = max(peaks[request_id], live)

    engine.start_branches = start  # type: ignore[method-assign]
    results = sart.run(
        requests,
        engine,
        ScriptedPRM(table, every=requests[0].policy.interval),
        batch_size=batch,
        scoring=scoring,
    )
    return results, engine, peaks, widths


@settings(max_examples=examples(300))
@given(
    work=forking_workloads(),
    scoring=st.sampled_from(sart.Scoring),
    cost=st.sampled_from([None, CPU_LIKE]),
)
def test_forking_runs_keep_every_invariant(work, scoring: sart.Scoring, cost) -> None:
    requests, scripts, batch = work
    if cost is not None:
        event("rows priced")
    results, engine, peaks, widths = run_forking(requests, scripts, batch, scoring, cost)
    # Every request ends exactly once, completed (no fault is injected), leaving nothing.
    assert [r.request_id for r in results] == [r.id for r in requests]
    assert all(r.ok for r in results), [r.reason for r in results]
    assert not engine.live_branches and not engine.prefixes
    assert engine.peak_live <= batch
    for request, result in zip(requests, results):
        assert peaks[request.id] <= widths[request.id]  # never more than n live
        n = request.policy.n
        forks = result.branches[n:]
        if forks:
            event("forked")
        for b in forks:
            parent = result.branches[b.parent]
            # Forked from a branch that ran at least as far as the child's start.
            assert parent.num_tokens >= b.inherited and b.inherited <= b.num_tokens
        assert all(b.parent is None for b in result.branches[:n])
        assert len([b for b in result.branches if b.status is S.PRUNED]) < len(result.branches)
        stop = request.policy.stop
        if any(b.status is S.STOPPED for b in result.branches) and isinstance(stop, sart.FirstM):
            # Stopped early: m branches (forks among them) had completed, not merely started.
            assert result.num_completed >= stop.m
    again = run_forking(requests, scripts, batch, scoring, cost)
    assert again[0] == results and again[1].log == engine.log


# ---------------------------------------------------------------- Reshare


def test_reshare_re_shares_when_idle_and_prunes_as_inner_when_busy() -> None:
    rule = sart.Reshare(sart.TwoPhasePrune(0.5, 1), temperature=0.2)
    view = request(branch(0, 0.9), branch(1, 0.45), branch(2, 0.3), branch(3, 0.8), load=load())
    # Idle: softmax(r / 0.2) shares the 4 slots 2, 0, 0, 2.
    assert sorted(rule.choose(view)) == [1, 2]
    assert rule.fork(view) == {0: 1, 3: 1}
    busy = attrs.evolve(view, load=load(waiting_requests=1))
    # Busy: TwoPhasePrune (alpha = 0.5, beta = 1) shrinks the request by one branch,
    # and the 3 slots left are re-shared: 2, 0, 0, 1 (branch 1 replaced by a fork of 0).
    assert list(rule.choose(busy)) == [2, 1]
    assert rule.fork(busy) == {0: 1}
    # busy="prune", or the KV cache full: TwoPhasePrune's own prunes, and no forks.
    pruning = attrs.evolve(rule, busy="prune")
    assert list(pruning.choose(busy)) == [2] and pruning.fork(busy) == {}
    # busy="replace": re-shares where TwoPhasePrune prunes (here), not at a check where
    # it prunes nothing (every reward above alpha), where "reshare" still re-shares.
    assert attrs.evolve(rule, busy="replace").fork(busy) == {0: 1}
    high = request(branch(0, 0.9), branch(1, 0.6), branch(2, 0.55), branch(3, 0.8))
    high = attrs.evolve(high, load=load(waiting_requests=1))
    assert attrs.evolve(rule, busy="replace").fork(high) == {}
    assert list(rule.choose(high)) and rule.fork(high)
    full = attrs.evolve(view, load=load(kv=95))
    assert list(rule.choose(full)) == [2] and rule.fork(full) == {}
    assert rule.start(4).threshold == 0.5 and rule.start(4).max_num_pruned > 4
    with pytest.raises(sart.ConfigError, match="kv_limit=0 must be in"):
        sart.Reshare(sart.NoPrune(), kv_limit=0)
    with pytest.raises(sart.ConfigError, match="busy='wait'"):
        sart.Reshare(sart.NoPrune(), busy="wait")


def test_sart_rebranch_falls_back_to_sart_at_saturation() -> None:
    # Two requests, one slot short of both: the first to be checked has the second
    # waiting, so it prunes as SART does and forks nothing.
    scripts = [
        BranchScript(length=30, answer="7", rewards=(0.9,), final_reward=0.9),
        BranchScript(length=30, answer="3", rewards=(0.1,)),
    ]
    table = ScriptTable({"a": scripts, "b": scripts})
    policy = sart.sart_rebranch(2, m=1, interval=10)
    requests = [sart.Request(rid, "p", policy, arrival=0.0) for rid in ("a", "b")]
    engine = FakeEngine(table, max_branches=3)
    results = sart.run(requests, engine, ScriptedPRM(table, every=10), batch_size=3)
    assert len(results[0].branches) == 2 and results[0].branches[1].status is S.PRUNED
    # Alone, the same request re-shares: branch 1 pruned, branch 0 forked.
    alone, _ = run_one(policy, scripts)
    assert len(alone.branches) == 3 and alone.branches[2].parent == 0


def costed(running: int, fixed: float | None, per_row: float | None) -> Load:
    return attrs.evolve(load(), running_branches=running, step_fixed=fixed, step_per_row=per_row)


def test_rows_cost_is_the_rows_share_of_a_step_fixed_cost() -> None:
    assert costed(8, 0.002, 0.00025).rows_cost(8) == pytest.approx(1.0)
    assert costed(8, None, None).rows_cost(8) is None
    assert costed(8, 0.0, 0.001).rows_cost(8) == float("inf")
    assert costed(8, 0.0, 0.0).rows_cost(8) == 0.0


def test_reshare_forks_only_while_rows_are_within_the_row_budget() -> None:
    rule = sart.Reshare(sart.TwoPhasePrune(0.5, 1), temperature=0.2, row_budget=1.0)
    view = request(branch(0, 0.9), branch(1, 0.45), branch(2, 0.3), branch(3, 0.8))
    cheap = attrs.evolve(view, load=costed(4, 0.002, 0.0004))  # rows add 0.8 of a step
    dear = attrs.evolve(view, load=costed(4, 0.002, 0.0006))  # rows add 1.2 of a step
    unfitted = attrs.evolve(view, load=costed(4, None, None))
    for idle in (cheap, unfitted):
        assert sorted(rule.choose(idle)) == [1, 2] and rule.fork(idle) == {0: 1, 3: 1}
    # Dear rows are load: TwoPhasePrune (alpha = 0.5, beta = 1) shrinks the request
    # by one branch and the 3 slots left are re-shared (as with a request waiting).
    assert list(rule.choose(dear)) == [2, 1] and rule.fork(dear) == {0: 1}
    assert attrs.evolve(rule, row_budget=None).fork(dear) == {0: 1, 3: 1}
    pruning = attrs.evolve(rule, busy="prune")
    assert list(pruning.choose(dear)) == [2] and pruning.fork(dear) == {}
    with pytest.raises(sart.ConfigError, match="row_budget=-1 must be None or a finite number > 0"):
        sart.Reshare(sart.NoPrune(), row_budget=-1)
