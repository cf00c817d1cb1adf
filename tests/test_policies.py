"""Stop rules, prune rules, selectors and recipes, on hand-made views."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

import sart
from sart.types import BranchStatus, Phase
from sart.views import BranchView, Limits, RequestView

S = BranchStatus


def branch(
    index: int,
    status: BranchStatus = S.RUNNING,
    reward: float | None = None,
    end_step: int | None = None,
    text: str = "",
    answer: str | None = None,
) -> BranchView:
    return BranchView(
        index=index,
        status=status,
        num_tokens=10,
        reward=reward,
        text=text,
        end_step=end_step,
        answer=answer,
    )


def request(branches: list[BranchView], limits: Limits, num_pruned: int = 0) -> RequestView:
    done = sum(1 for b in branches if b.status.is_completed)
    return RequestView(
        request_id="q",
        n=len(branches),
        phase=Phase.EXPLORE,
        limits=limits,
        num_completed=done,
        num_pruned=num_pruned,
        branches=tuple(branches),
    )


def test_two_phase_prune_limits_follow_the_paper() -> None:
    rule = sart.TwoPhasePrune(alpha=0.4, beta=2)
    assert rule.start(8) == Limits(threshold=0.4, max_num_pruned=2)
    first = branch(3, S.FINISHED, reward=0.77, end_step=10)
    assert rule.enter_exploit(Limits(0.4, 2), first, 8) == Limits(0.77, 7)


def test_two_phase_prune_chooses_below_threshold_lowest_first() -> None:
    view = request(
        [
            branch(0, reward=0.3),
            branch(1, reward=0.1),
            branch(2, reward=0.6),
            branch(3, reward=None),
            branch(4, S.PRUNED, reward=0.0),
            branch(5, reward=0.1),
        ],
        Limits(0.5, 5),
    )
    assert list(sart.TwoPhasePrune(0.5, 2).choose(view)) == [1, 5, 0]


def test_no_prune_is_inactive_and_custom_rules_are_active() -> None:
    class Mine(sart.PruneRule):
        def choose(self, request: RequestView) -> list[int]:
            return []

    assert not sart.NoPrune().active
    assert not sart.PruneRule().active
    assert Mine().active and sart.TwoPhasePrune(0.5, 1).active


def test_first_m_and_all_done() -> None:
    view = request(
        [branch(0, S.FINISHED, end_step=1), branch(1, S.TRUNCATED, end_step=2), branch(2)],
        Limits(None, 2),
    )
    assert sart.FirstM(2).should_stop(view)
    assert not sart.FirstM(3).should_stop(view)
    assert not sart.AllDone().should_stop(view)


def answered(index: int, answer: str, status: BranchStatus = S.FINISHED) -> BranchView:
    """A completed branch as a stop rule that reads answers sees it."""
    return branch(index, status, end_step=index, answer=answer)


def test_agreement_stops_once_k_finished_branches_agree_or_m_completed() -> None:
    rule = sart.Agreement(4)
    assert rule.needs_answers and not sart.FirstM(4).needs_answers
    split = [answered(0, "1"), answered(1, "2"), branch(2), branch(3)]
    assert not rule.should_stop(request(split, Limits(None, 2)))
    agreed = [*split[:2], answered(2, "2"), branch(3)]
    assert rule.should_stop(request(agreed, Limits(None, 2)))
    assert not sart.Agreement(4, k=3).should_stop(request(agreed, Limits(None, 2)))
    # A branch cut at max_tokens wrote no conclusion, and an empty answer is none.
    cut = [answered(0, "2"), answered(1, "2", S.TRUNCATED), answered(2, ""), answered(3, "")]
    assert not rule.should_stop(request([*cut[:3], branch(3)], Limits(None, 2)))
    # m completed finish it whatever they say.
    assert rule.should_stop(request(cut, Limits(None, 2)))


def test_agreement_groups_answers_by_its_equivalence() -> None:
    class Numeric(sart.Equivalence):
        def key(self, answer: str) -> float:
            return float(answer)

    pair = [answered(0, "0.5"), answered(1, ".50"), branch(2), branch(3)]
    assert not sart.Agreement(4).should_stop(request(pair, Limits(None, 2)))
    assert sart.Agreement(4, equivalence=Numeric()).should_stop(request(pair, Limits(None, 2)))


def test_best_reward_breaks_ties_by_completion_then_index() -> None:
    cands = [
        branch(0, S.FINISHED, 0.8, end_step=9),
        branch(1, S.FINISHED, 0.9, end_step=20),
        branch(2, S.FINISHED, 0.9, end_step=12),
        branch(3, S.FINISHED, 0.9, end_step=12),
    ]
    assert sart.BestReward().choose(cands, ["a", "b", "c", "d"]) == 2
    unscored = [branch(0, S.FINISHED, end_step=5), branch(1, S.FINISHED, end_step=3)]
    assert sart.BestReward().choose(unscored, ["a", "b"]) == 1


def test_majority_vote_counts_answers_and_ignores_empty_ones() -> None:
    cands = [branch(i, S.FINISHED, end_step=i) for i in range(5)]
    assert sart.MajorityVote().choose(cands, ["1", "2", "2", "", ""]) == 1
    # A tie goes to the answer that completed first.
    assert sart.MajorityVote().choose(cands[:4], ["1", "2", "2", "1"]) == 0
    assert sart.MajorityVote().choose(cands[:2], ["", ""]) == 0


def test_weighted_vote_sums_rewards_per_answer() -> None:
    cands = [
        branch(0, S.FINISHED, 0.9, end_step=1),
        branch(1, S.FINISHED, 0.5, end_step=2),
        branch(2, S.FINISHED, 0.6, end_step=3),
    ]
    # "x": 0.9 vs "y": 0.5 + 0.6 = 1.1 -> "y", and its best branch is 2.
    assert sart.WeightedVote().choose(cands, ["x", "y", "y"]) == 2
    assert sart.MajorityVote().choose(cands, ["x", "y", "y"]) == 1


def test_recipes_use_the_paper_defaults() -> None:
    p = sart.sart(8)
    assert p.stop == sart.FirstM(4)
    assert p.prune == sart.TwoPhasePrune(alpha=0.5, beta=4)
    assert p.select == sart.BestReward()
    assert p.interval == 400
    assert sart.sart(1).stop == sart.FirstM(1) and sart.sart(1).prune.beta == 0
    assert sart.sart(5).stop == sart.FirstM(2)
    sc = sart.self_consistency(4)
    assert (sc.n, sc.stop, sc.prune, sc.select) == (
        4,
        sart.AllDone(),
        sart.NoPrune(),
        sart.MajorityVote(),
    )
    assert sart.vanilla().n == 1 and not sart.vanilla().scores_completed
    ablation = sart.sart_without_pruning(8)
    assert ablation.stop == sart.FirstM(4) and not ablation.prune.active


def test_which_policies_need_a_prm() -> None:
    assert sart.sart(4).scores_running and sart.sart(4).scores_completed
    assert not sart.self_consistency(4).scores_completed
    assert sart.sart_without_pruning(4).scores_completed  # best-reward selection
    assert not sart.sart_without_pruning(4).scores_running


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sart.sart(0), "n=0 must be >= 1"),
        (lambda: sart.sart(8, m=9), "m=9 must be <= n=8"),
        (lambda: sart.sart(8, m=0), "m=0 must be >= 1"),
        (lambda: sart.sart(8, beta=8), "beta=8 must be < n=8"),
        (lambda: sart.sart(8, beta=-1), "beta=-1 must be >= 0"),
        (lambda: sart.sart(8, alpha=1.5), "alpha=1.5 must be in [0, 1]"),
        (lambda: sart.sart(8, alpha=-0.1), "alpha=-0.1 must be in [0, 1]"),
        (lambda: sart.sart(8, interval=0), "interval=0 must be >= 1"),
        (lambda: sart.self_consistency(0), "n=0 must be >= 1"),
        (lambda: sart.Policy(n=4, stop=sart.Agreement(5)), "m=5 must be <= n=4"),
        (lambda: sart.Agreement(2, k=3).validate(4), "k=3 must be <= m=2"),
        (lambda: sart.Agreement(2, k=1), "k=1 must be >= 2"),
        (lambda: sart.Agreement(2, equivalence=str), "must be an Equivalence"),
        (lambda: sart.Policy(n=2, stop="first"), "stop='first' must be a StopRule"),
        (lambda: sart.Policy(n=2, prune=None), "prune=None must be a PruneRule"),
        (lambda: sart.Policy(n=2, select=max), "must be a Selector"),
        (lambda: sart.SchedulerConfig(batch_size=0), "batch_size=0 must be >= 1"),
        (lambda: sart.SchedulerConfig(batch_size=True), "batch_size=True must be >= 1"),
    ],
)
def test_bad_configuration_names_field_and_value(make, message: str) -> None:
    with pytest.raises(sart.ConfigError) as info:
        make()
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sart.sart_adaptive(4, m=9), "m=9 must be None or in [1, n=4]"),
        (lambda: sart.sart_adaptive(4, keep=0), "keep=0 must be None or >= 1"),
        (lambda: sart.Reshare(None), "inner=None must be a PruneRule"),
        (lambda: sart.ShedUnderLoad(None), "inner=None must be a PruneRule"),
    ],
)
def test_recipes_and_wrappers_refuse_what_they_would_otherwise_change_or_crash_on(
    make: Callable[[], object], message: str
) -> None:
    with pytest.raises(sart.ConfigError, match=re.escape(message)):
        make()
