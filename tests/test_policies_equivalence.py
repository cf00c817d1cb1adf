"""Votes under an answer equivalence: the default is today's exact match, bit for bit;
custom equivalences group deterministically (first-seen representative, completion order)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sart
from sart.policies.equivalence import Equivalence, ExactMatch, group_answers
from sart.testing import BranchScript, FakeEngine, ScriptedPRM
from sart.types import BranchStatus
from sart.views import BranchView, completion_order


def view(index: int, end_step: int, reward: float | None = None) -> BranchView:
    return BranchView(index, BranchStatus.FINISHED, 10, reward, "", end_step)


def old_voting(
    candidates: Sequence[BranchView], answers: Sequence[str]
) -> dict[str, list[BranchView]]:
    """The selectors' grouping before equivalences existed, verbatim."""
    groups: dict[str, list[BranchView]] = {}
    for branch, answer in sorted(zip(candidates, answers), key=lambda p: completion_order(p[0])):
        groups.setdefault(answer, []).append(branch)
    if len(groups) > 1:
        groups.pop("", None)
    return groups


def _reward(b: BranchView) -> float:
    return b.reward if b.reward is not None else float("-inf")


def old_majority(candidates: Sequence[BranchView], answers: Sequence[str]) -> int:
    return max(old_voting(candidates, answers).values(), key=len)[0].index


def old_weighted(candidates: Sequence[BranchView], answers: Sequence[str]) -> int:
    groups = old_voting(candidates, answers)
    winner = max(groups.values(), key=lambda g: sum(b.reward for b in g if b.reward is not None))
    return min(winner, key=lambda b: (-_reward(b), *completion_order(b))).index


#: Answers with ties, an empty one, and "01" (which is "1" by value).
ANSWERS = st.sampled_from(["", "1", "2", "3", "01"])


@st.composite
def ballots(draw: st.DrawFn) -> tuple[list[BranchView], list[str]]:
    """Completed branches (ties in end step and reward likely) and their answers."""
    n = draw(st.integers(1, 10))
    ends = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    rewards = draw(
        st.lists(st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0])), min_size=n, max_size=n)
    )
    indices = draw(st.permutations(range(n)))
    views = [view(i, e, r) for i, e, r in zip(indices, ends, rewards)]
    return views, draw(st.lists(ANSWERS, min_size=n, max_size=n))


@given(ballots())
def test_the_default_votes_exactly_as_before(ballot: tuple[list[BranchView], list[str]]) -> None:
    views, answers = ballot
    assert sart.MajorityVote().choose(views, answers) == old_majority(views, answers)
    assert sart.WeightedVote().choose(views, answers) == old_weighted(views, answers)
    explicit = sart.MajorityVote(equivalence=ExactMatch())
    assert explicit == sart.MajorityVote() and explicit.choose(views, answers) == old_majority(
        views, answers
    )


@attrs.frozen
class Numeric(Equivalence):
    """Answers that are integers compare by value ("01" is "1"), through ``same``;
    ``calls`` records each comparison."""

    calls: list[tuple[str, str]] = attrs.field(factory=list, eq=False)

    def same(self, a: str, b: str) -> bool:
        self.calls.append((a, b))
        return a.isdigit() and b.isdigit() and int(a) == int(b)


@attrs.frozen
class ByValue(Equivalence):
    """The same equivalence as ``Numeric``, through ``key`` only."""

    def key(self, answer: str) -> object:
        return int(answer) if answer.isdigit() else answer


@given(ballots())
def test_key_and_same_group_alike_whatever_the_order_of_the_candidates(
    ballot: tuple[list[BranchView], list[str]],
) -> None:
    views, answers = ballot
    chosen = set()
    for order in (list(range(len(views))), list(reversed(range(len(views))))):
        v = [views[i] for i in order]
        a = [answers[i] for i in order]
        by_same = sart.MajorityVote(equivalence=Numeric()).choose(v, a)
        by_key = sart.MajorityVote(equivalence=ByValue()).choose(v, a)
        assert by_same == by_key
        assert sart.WeightedVote(equivalence=Numeric()).choose(v, a) == sart.WeightedVote(
            equivalence=ByValue()
        ).choose(v, a)
        chosen.add(by_same)
    assert len(chosen) == 1  # the input order does not matter: completion order does


def test_same_is_asked_once_per_group_and_new_spelling_with_the_representative_first() -> None:
    views = [view(i, i) for i in range(6)]
    eq = Numeric()
    groups = group_answers(views, ["2", "1", "02", "2", "01", "02"], eq)
    assert [[b.index for b in g] for g in groups] == [[0, 2, 3, 5], [1, 4]]
    # "2" and "1" form groups; "02" is compared with "2" (a match) and never again;
    # "01" with "2" then "1". Identical strings share their key: no call.
    assert eq.calls == [("2", "1"), ("2", "02"), ("2", "01"), ("1", "01")]


def test_votes_count_equivalent_answers_together() -> None:
    views = [view(i, i, reward=r) for i, r in enumerate([0.9, 0.2, 0.3, 0.3, 0.8])]
    answers = ["7", "3", "03", "003", "7"]
    assert sart.MajorityVote().choose(views, answers) == 0  # "7" twice, the others once
    assert sart.MajorityVote(equivalence=Numeric()).choose(views, answers) == 1  # 3 x three
    assert sart.WeightedVote().choose(views, answers) == 0  # "7": 1.7
    assert sart.WeightedVote(equivalence=Numeric()).choose(views, answers) == 0  # 1.7 > 0.8
    answers[1] = "0"  # "03", "003" against "7", "7": a tie goes to the first completed
    assert sart.MajorityVote(equivalence=Numeric()).choose(views, answers) == 0


def test_empty_answers_vote_only_alone_and_are_never_compared() -> None:
    views = [view(i, i) for i in range(4)]
    eq = Numeric()
    assert sart.MajorityVote(equivalence=eq).choose(views, ["", "", "", "5"]) == 3
    assert sart.MajorityVote(equivalence=eq).choose(views, ["", "", "", ""]) == 0
    assert eq.calls == []
    assert group_answers([], [], eq) == []


def test_exact_match_never_compares() -> None:
    assert not ExactMatch().compares and Numeric().compares and not ByValue().compares
    assert sart.Equivalence is Equivalence and sart.ExactMatch is ExactMatch


def test_a_vote_refuses_what_is_not_an_equivalence() -> None:
    with pytest.raises(sart.ConfigError, match="equivalence='exact' must be an Equivalence"):
        sart.MajorityVote(equivalence="exact")  # type: ignore[arg-type]


def test_the_scheduler_answers_with_the_winning_groups_first_branch() -> None:
    # Four branches end in this order; "04", "4" and "004" are one answer by value.
    answers = ["3", "04", "4", "004"]
    script = {"q": [BranchScript(length=10 * (i + 1), answer=a) for i, a in enumerate(answers)]}

    def serve(select: sart.Selector) -> sart.RequestResult:
        policy = sart.Policy(n=4, select=select, interval=8)
        request = sart.Request(id="q", prompt="p", policy=policy)
        return sart.run([request], FakeEngine(script), ScriptedPRM(script, every=8))[0]

    exact = serve(sart.MajorityVote())
    assert (exact.chosen, exact.answer) == (0, "3")  # four singletons: the first one wins
    for equivalence in (Numeric(), ByValue()):
        result = serve(sart.MajorityVote(equivalence=equivalence))
        assert (result.chosen, result.answer) == (1, "04")  # three votes for 4
