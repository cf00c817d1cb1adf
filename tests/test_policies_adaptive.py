"""Branching by load (``sart.policies.adaptive``): the load policies see, the admission
rule, shedding under pressure, and ``sart_adaptive`` end to end on the fake engine."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import pytest

import sart
from sart import BranchStatus, Load, Phase
from sart.policies.adaptive import fair_share
from sart.testing import BranchScript, FakeEngine, ScriptedPRM
from sart.views import BranchView, Limits, RequestView


def load(**fields: object) -> Load:
    base: dict[str, object] = dict(
        waiting_requests=0,
        waiting_branches=0,
        running_branches=0,
        budget=16,
        active_requests=0,
        arrival_rate=None,
        waited=0.0,
    )
    return Load(**{**base, **fields})  # type: ignore[arg-type]


# ---------------------------------------------------------------- the admission rule


def test_fair_share_divides_the_free_slots_among_the_queue() -> None:
    assert fair_share(load()) == 16
    assert fair_share(load(running_branches=10)) == 6
    assert fair_share(load(running_branches=10, waiting_branches=2, waiting_requests=1)) == 2
    assert fair_share(load(running_branches=16, waiting_requests=5)) == 0
    assert load(running_branches=20).free_slots == 0
    assert load(kv_tokens=50, kv_capacity=200).kv_use == 0.25 and load().kv_use is None


def test_branch_by_load_stays_between_its_floor_and_the_ceiling() -> None:
    rule = sart.BranchByLoad(floor=2)
    assert rule.branches(8, load()) == 8  # idle: the ceiling
    assert rule.branches(8, load(running_branches=12)) == 4
    assert rule.branches(8, load(running_branches=16, waiting_requests=3)) == 2  # the floor
    assert rule.branches(1, load(running_branches=16)) == 1  # a floor above the ceiling
    # While the PRM is behind, prm_floor (1 by default), whatever the batch.
    assert rule.branches(8, load(prm_waiting=3)) == 1
    assert sart.BranchByLoad(prm_floor=3).branches(8, load(prm_waiting=1)) == 3
    policy = rule.admit(sart.self_consistency(8), load(running_branches=13))
    assert (policy.n, policy.name) == (3, "self-consistency(n=8)")
    with pytest.raises(sart.ConfigError, match="floor"):
        sart.BranchByLoad(floor=0)


def test_sart_adaptive_sizes_m_and_beta_to_the_branches_it_gets() -> None:
    policy = sart.sart_adaptive(8, interval=16)
    assert policy.n == 8 and policy.name == "sart-adaptive(n=2..8)"
    busy = policy.admit.admit(policy, load(running_branches=16, waiting_requests=4))
    assert busy.n == 2 and busy.stop == sart.FirstM(1) and busy.name == policy.name
    assert busy.prune == sart.ShedUnderLoad(inner=sart.TwoPhasePrune(0.5, 1), keep=1)
    some = policy.admit.admit(policy, load(running_branches=10))
    assert some.n == 6 and some.stop == sart.FirstM(3)
    assert some.prune == sart.ShedUnderLoad(inner=sart.TwoPhasePrune(0.5, 3), keep=2)
    explicit = sart.sart_adaptive(8, m=6, beta=5, keep=3, floor=4)
    low = explicit.admit.admit(explicit, load(running_branches=16))
    assert low.n == 4 and low.stop == sart.FirstM(4)
    assert low.prune == sart.ShedUnderLoad(inner=sart.TwoPhasePrune(0.5, 3), keep=3)
    with pytest.raises(sart.ConfigError, match="floor=9"):
        sart.sart_adaptive(8, floor=9)


# ---------------------------------------------------------------- shedding


def view(
    rewards: Iterable[float | None], *, phase: Phase = Phase.EXPLORE, **fields: object
) -> RequestView:
    branches = tuple(
        BranchView(i, BranchStatus.RUNNING, 10 + i, r, "", None) for i, r in enumerate(rewards)
    )
    return RequestView(
        request_id="r",
        n=len(branches),
        phase=phase,
        limits=Limits(threshold=0.5, max_num_pruned=len(branches) - 1),
        num_completed=0,
        num_pruned=0,
        branches=branches,
        load=load(**fields) if fields else None,
    )


def test_shedding_prunes_the_lowest_rewards_for_the_work_that_waits() -> None:
    rule = sart.ShedUnderLoad(inner=sart.NoPrune(), keep=2)
    rewards = [0.9, 0.7, None, 0.8, 0.6, 0.95]
    assert list(rule.choose(view(rewards))) == []  # no load measured: nothing to shed
    assert list(rule.choose(view(rewards, waiting_requests=0))) == []
    assert list(rule.choose(view(rewards, waiting_requests=1))) == [4]
    assert list(rule.choose(view(rewards, waiting_requests=1, waiting_branches=2))) == [4, 1, 3]
    # Never below keep; unscored branches go last.
    assert list(rule.choose(view(rewards, waiting_requests=9))) == [4, 1, 3, 0]


def test_shedding_leaves_the_inner_rule_its_own_budget() -> None:
    rule = sart.ShedUnderLoad(inner=sart.TwoPhasePrune(alpha=0.5, beta=1), keep=1)
    rewards = [0.1, 0.2, 0.3, 0.9]
    assert rule.start(4) == Limits(threshold=0.5, max_num_pruned=3)
    # Phase 1: the inner rule prunes at most beta = 1 of the three below alpha...
    assert list(rule.choose(view(rewards))) == [0]
    # ...and the load sheds the next lowest for one waiting request.
    assert list(rule.choose(view(rewards, waiting_requests=1))) == [0, 1]
    # Phase 2: the inner rule's budget is n - 1.
    exploit = attrs.evolve(view(rewards), phase=Phase.EXPLOIT)
    assert list(rule.choose(exploit)) == [0, 1, 2]
    first = BranchView(9, BranchStatus.FINISHED, 30, 0.4, "", 3)
    assert rule.enter_exploit(rule.start(4), first, 4) == Limits(threshold=0.4, max_num_pruned=3)


def test_shedding_forks_only_where_its_inner_rule_does() -> None:
    from sart.servable import check_servable

    assert not sart.ShedUnderLoad(inner=sart.TwoPhasePrune(0.5, 1)).forks
    assert sart.ShedUnderLoad(inner=sart.RewardBalance()).forks
    assert sart.ShedUnderLoad(inner=sart.NoPrune()).active  # it prunes: shedding

    class NoFork(FakeEngine):  # as vLLM's and SGLang's adapters
        supports_fork = False

    # sart-adaptive is served by engines that cannot fork (it never forks).
    check_servable(sart.Request("a", "p", sart.sart_adaptive(8)), ScriptedPRM(), NoFork())


def test_a_requests_own_waiting_branches_are_not_pressure() -> None:
    rule = sart.ShedUnderLoad(inner=sart.NoPrune(), keep=1)
    v = view([0.2, 0.4], waiting_branches=2)
    own = tuple(attrs.evolve(b, status=BranchStatus.WAITING) for b in view([0.5, 0.5]).branches)
    mine = attrs.evolve(
        v, branches=v.branches + tuple(attrs.evolve(b, index=2 + i) for i, b in enumerate(own))
    )
    assert list(rule.choose(mine)) == []  # both waiting branches are this request's
    assert list(rule.choose(v)) == [0]  # another request's


# ---------------------------------------------------------------- end to end


class Recording(sart.AdmitRule):
    """Serves as given; remembers the load each admission saw."""

    def __init__(self) -> None:
        self.seen: list[Load] = []

    def admit(self, policy: sart.Policy, load: Load) -> sart.Policy:
        self.seen.append(load)
        return policy


def scripts(count: int, n: int, length: int = 40) -> dict[str, list[BranchScript]]:
    return {
        f"r{i}": [BranchScript(length=length + 7 * j, rewards=(0.1 * (j + 1),)) for j in range(n)]
        for i in range(count)
    }


def test_admission_sees_the_queue_the_slots_and_the_arrival_rate() -> None:
    rule = Recording()
    policy = attrs.evolve(sart.self_consistency(4, interval=8), admit=rule)
    table = scripts(3, 4)
    requests = [sart.Request(f"r{i}", "q", policy, arrival=2.0 * i) for i in range(3)]
    engine = FakeEngine(table, step_cost=1.0)
    results = sart.run(requests, engine, ScriptedPRM(table, every=8), batch_size=6)
    assert all(r.ok for r in results)
    first, second, third = rule.seen
    assert (first.budget, first.running_branches, first.waiting_requests) == (6, 0, 0)
    assert first.arrival_rate is None and first.waited == 0.0
    # The second arrives at t=2 while the first's 4 branches run: 2 slots are free.
    assert second.running_branches == 4 and second.free_slots == 2
    assert second.arrival_rate == pytest.approx(0.5)
    assert third.waited >= 0.0 and third.active_requests >= 1


def test_the_load_shows_checks_waiting_for_a_busy_prm() -> None:
    # A PRM whose every call takes 50 time units, one call at a time: r0's first check
    # is in flight from t=4 to 54; r1 (admitted at 10) is due at 14 and waits for it;
    # r2, admitted at 20, sees that.
    rule = Recording()
    policy = attrs.evolve(sart.sart(2, interval=4), admit=rule)
    table = scripts(3, 2, length=120)
    requests = [sart.Request(f"r{i}", "q", policy, arrival=10.0 * i) for i in range(3)]
    prm = sart.CostedPRM(ScriptedPRM(table, every=4), lambda _items: 50.0)
    results = sart.run(requests, FakeEngine(table, step_cost=1.0), prm, batch_size=8)
    assert all(r.ok for r in results)
    assert [x.prm_waiting for x in rule.seen] == [0, 0, 1]


def test_checks_see_the_load_too() -> None:
    seen: list[Load | None] = []

    class Watching(sart.PruneRule):
        def choose(self, request: RequestView) -> Iterable[int]:
            seen.append(request.load)
            return ()

    policy = sart.Policy(n=2, prune=Watching(), interval=8)
    table = scripts(2, 2)
    requests = [sart.Request(f"r{i}", "q", policy) for i in range(2)]
    sart.run(requests, FakeEngine(table), ScriptedPRM(table, every=8), batch_size=2)
    assert seen and all(isinstance(x, Load) for x in seen)
    assert seen[0].waiting_requests == 1 and seen[0].running_branches == 2


def test_alone_the_adaptive_policy_serves_as_sart_at_its_ceiling() -> None:
    # A request at a time, each after the last has ended: the server is always idle.
    table = scripts(5, 8)
    adaptive = sart.sart_adaptive(8, interval=8)
    plain = sart.sart(8, interval=8)

    def serve(policy: sart.Policy) -> list[sart.RequestResult]:
        requests = [sart.Request(f"r{i}", "q", policy, arrival=1000.0 * i) for i in range(5)]
        engine = FakeEngine(table, step_cost=1.0)
        return sart.run(requests, engine, ScriptedPRM(table, every=8), batch_size=16)

    def served(results: list[sart.RequestResult]) -> list[object]:
        # All but the PRM's bookkeeping: after phase 1's beta prunes SART stops scoring
        # running branches until a completion; the adaptive policy scores on, as it may
        # have to shed (more PRM items, the same branches, answers and timings).
        return [
            (
                r.status, r.chosen, r.answer, r.timings,
                [(b.status, b.num_tokens, b.reward, b.ended_in) for b in r.branches],
            )
            for r in results
        ]  # fmt: skip

    ours, theirs = serve(adaptive), serve(plain)
    assert served(ours) == served(theirs)
    assert {r.policy for r in ours} == {"sart-adaptive(n=2..8)"}
    assert sum(r.prm_items for r in ours) >= sum(r.prm_items for r in theirs)


def test_under_load_requests_get_fewer_branches_and_busy_ones_shed() -> None:
    table = scripts(6, 8, length=200)
    policy = sart.sart_adaptive(8, interval=8)
    requests = [sart.Request(f"r{i}", "q", policy, arrival=float(i)) for i in range(6)]
    engine = FakeEngine(table, step_cost=1.0)
    results = sart.run(requests, engine, ScriptedPRM(table, every=8), batch_size=12)
    assert all(r.ok for r in results)
    widths = [len(r.branches) for r in results]
    assert widths[0] == 8 and min(widths) == 2  # idle first, then the floor
    assert engine.peak_live <= 12
    # The first request shed branches for the later ones.
    first = results[0]
    assert sum(b.status is BranchStatus.PRUNED for b in first.branches) >= 1


@pytest.mark.parametrize(
    ("admit", "reason"),
    [
        (lambda policy, load: sart.self_consistency(9), "a Policy with 1 to 4 branches"),
        (lambda policy, load: "eight", "a Policy with 1 to 4 branches"),
        (lambda policy, load: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_a_broken_admission_rule_fails_its_request_only(admit: object, reason: str) -> None:
    class Broken(sart.AdmitRule):
        def admit(self, policy: sart.Policy, load: Load) -> sart.Policy:
            return admit(policy, load)  # type: ignore[operator,no-any-return]

    table = scripts(2, 4)
    broken = attrs.evolve(sart.self_consistency(4, interval=8), admit=Broken())
    requests = [
        sart.Request("r0", "q", broken),
        sart.Request("r1", "q", sart.self_consistency(4, interval=8)),
    ]
    engine = FakeEngine(table)
    bad, good = sart.run(requests, engine, ScriptedPRM(table, every=8), batch_size=8)
    assert bad.status is sart.RequestStatus.FAILED and reason in (bad.reason or "")
    assert good.ok
    assert engine.live_branches == frozenset() and engine.prefixes == frozenset()


def test_an_admission_rule_may_not_settle_on_more_than_the_driver_set_up() -> None:
    # Majority vote needs no PRM, so a driver without one accepts the request; the rule
    # then settles on SART, whose checks would reach the PRM the driver lacks. That
    # request fails with a reason; the run and the other request go on.
    class ToSart(sart.AdmitRule):
        def admit(self, policy: sart.Policy, load: Load) -> sart.Policy:
            return sart.sart(policy.n, m=2, interval=8)

    table = scripts(2, 4)
    needy = attrs.evolve(sart.self_consistency(4, interval=8), admit=ToSart())
    requests = [
        sart.Request("r0", "q", needy),
        sart.Request("r1", "q", sart.self_consistency(4, interval=8)),
    ]
    engine = FakeEngine(table)
    bad, good = sart.run(requests, engine, None, batch_size=8)
    assert bad.status is sart.RequestStatus.FAILED
    assert "needs rewards for its running branches" in (bad.reason or "")
    assert good.ok and len(good.branches) == 4
    assert engine.live_branches == frozenset() and engine.prefixes == frozenset()


def test_an_admission_rule_may_narrow_the_policy() -> None:
    # Fewer branches and no pruning need nothing the submitted SART did not.
    class Narrow(sart.AdmitRule):
        def admit(self, policy: sart.Policy, load: Load) -> sart.Policy:
            return sart.self_consistency(2, interval=8)

    table = scripts(1, 4)
    policy = attrs.evolve(sart.sart(4, m=2, interval=8), admit=Narrow())
    (result,) = sart.run(
        [sart.Request("r0", "q", policy)],
        FakeEngine(table),
        ScriptedPRM(table, every=8),
        batch_size=8,
    )
    assert result.ok and len(result.branches) == 2


@pytest.mark.parametrize(
    ("submitted", "settled", "beyond"),
    [
        (sart.sart(4), sart.sart(2), ""),
        (sart.rebase(4), sart.sart(2), ""),  # narrower: fewer needs
        (sart.sart(4), sart.sart_confidence(4), "another reward source"),
        (sart.self_consistency(4), sart.sart(4), "rewards for its running branches"),
        (sart.self_consistency(4), sart.sart_without_pruning(4), "rewards for its completed"),
        (sart.sart(4), sart.rebase(4), "forks"),
    ],
)
def test_what_a_settled_policy_needs_beyond_the_submitted_one(
    submitted: sart.Policy, settled: sart.Policy, beyond: str
) -> None:
    from sart.scheduler.hooks import needs_beyond

    assert needs_beyond(submitted, settled).startswith(beyond)
    assert bool(needs_beyond(submitted, settled)) == bool(beyond)
