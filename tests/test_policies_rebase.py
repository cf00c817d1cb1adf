"""Rebase on the scheduler: reward-balanced re-sharing, forks into freed slots."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

import sart
from sart.policies.reward_balance import allocate
from sart.testing import BranchScript, FakeEngine, ScriptedPRM, ScriptTable
from sart.types import BranchId, BranchStatus
from sart.views import BranchView

S = BranchStatus


def leaves(*rewards: float | None) -> list[BranchView]:
    return [
        BranchView(index=i, status=S.RUNNING, num_tokens=10, reward=r, text="", end_step=None)
        for i, r in enumerate(rewards)
    ]


def test_equal_rewards_keep_every_leaf() -> None:
    assert allocate(leaves(0.5, 0.5, 0.5, 0.5), 0.2) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_a_dominant_leaf_takes_the_slots_of_the_weak_ones() -> None:
    # softmax(r / 0.1): exp(0), exp(-5), exp(-6), exp(-7) -> quotas 3.97, 0.03, 0.01, 0.004.
    assert allocate(leaves(0.9, 0.4, 0.3, 0.2), 0.1) == {0: 4, 1: 0, 2: 0, 3: 0}


def test_largest_remainders_then_higher_reward() -> None:
    # Quotas 1.5, 1.5, 0 (after rounding): one extra slot, to the higher reward.
    shares = allocate(leaves(0.8, 0.8, 0.0), 0.05)
    assert sum(shares.values()) == 3
    assert shares == {0: 2, 1: 1, 2: 0}


def test_unscored_leaves_are_left_alone() -> None:
    assert allocate(leaves(0.9, None), 0.2) == {}


def test_recipe_and_validation() -> None:
    policy = sart.rebase(4)
    assert policy.prune == sart.RewardBalance(temperature=0.2)
    assert policy.select == sart.WeightedVote()
    assert policy.stop == sart.AllDone()
    assert policy.prune.forks and not sart.TwoPhasePrune(0.5, 1).forks
    with pytest.raises(sart.ConfigError, match="temperature=0 must be > 0"):
        sart.RewardBalance(temperature=0)


def test_rebase_forks_the_best_leaf_into_the_slots_it_frees() -> None:
    # One table for the engine and the PRM, so the PRM sees the forked children.
    script = ScriptTable(
        {
            "q": [
                BranchScript(length=30, answer="4", rewards=(0.9,)),
                BranchScript(length=30, answer="5", rewards=(0.1,)),
                BranchScript(length=30, answer="6", rewards=(0.1,)),
            ]
        }
    )
    engine = FakeEngine(script, max_branches=3)
    prm = ScriptedPRM(script, every=10)
    (result,) = sart.run(
        [sart.Request("q", "p", sart.rebase(3, temperature=0.1, interval=10))],
        engine,
        prm,
        batch_size=3,
    )
    # Check at 10: shares 3, 0, 0 -> branches 1 and 2 pruned, branch 0 forked twice
    # (children 3 and 4 start from its 10 tokens and follow its script to 30).
    assert ("start", "q", (3, 4)) in engine.log
    assert [b.status for b in result.branches] == [
        S.FINISHED,
        S.PRUNED,
        S.PRUNED,
        S.FINISHED,
        S.FINISHED,
    ]
    assert [b.num_tokens for b in result.branches] == [30, 10, 10, 30, 30]
    assert result.answer == "4"
    assert engine.peak_live == 3
    assert not engine.live_branches and not engine.prefixes


def test_forks_never_take_more_slots_than_the_prunes_freed() -> None:
    class Greedy(sart.PruneRule):
        def choose(self, request: sart.RequestView) -> list[int]:
            return [request.running[-1].index]

        def fork(self, request: sart.RequestView) -> Mapping[int, int]:
            return {request.running[0].index: 2}

    script = {"q": [BranchScript(length=30, rewards=(0.5,))] * 2}
    policy = sart.Policy(n=2, prune=Greedy(), select=sart.MajorityVote(), interval=10)
    (result,) = sart.run(
        [sart.Request("q", "p", policy)], FakeEngine(script), ScriptedPRM(script, every=10)
    )
    assert not result.ok
    assert "asked for 2 new branches; pruning freed 1 slots" in (result.reason or "")


def test_a_forking_policy_needs_an_engine_that_forks() -> None:
    class NoFork(FakeEngine):
        supports_fork = False

    driver = sart.SyncDriver(NoFork(), ScriptedPRM(), batch_size=4)
    with pytest.raises(sart.ConfigError, match="does not support forking"):
        driver.submit(sart.Request("q", "p", sart.rebase(2)))


def test_fork_of_a_dead_branch_is_misuse() -> None:
    from sart.engines.base import BranchSpec
    from sart.testing import EngineMisuse

    engine = FakeEngine()
    engine.prefill("q", "p", sart.SamplingSettings(max_tokens=5))
    with pytest.raises(EngineMisuse, match="fork from branch"):
        engine.start_branches("q", [BranchSpec(1, 1, parent=0)])
    assert BranchId("q", 1) not in engine.live_branches
