"""Rollout shape (``sart.rollouts``): per-question statistics on hand-made rollouts."""

from __future__ import annotations

import math

import pytest

from sart.bench.traces import Trace, TraceRequest
from sart.engines.scripts import BranchScript
from sart.rollouts import REAL_RANGES, Rollout, pearson, rollout_shape, trace_rollouts


def group(*items: tuple[int, bool]) -> list[Rollout]:
    return [Rollout(length, ok, answer="4" if ok else "5") for length, ok in items]


def test_the_shape_of_two_questions_by_hand() -> None:
    first = group((100, True), (200, False))  # wrong one longer: r = -1
    second = group((300, True), (100, True), (200, False))
    shape = rollout_shape([first, second])
    assert shape.questions == 2 and shape.rollouts == 2
    assert shape.median_length == 200 and shape.longest == 300
    assert shape.median_spread == pytest.approx((2.0 + 3.0) / 2)
    assert shape.median_cv == pytest.approx((50 / 150 + math.sqrt(20000 / 3) / 200) / 2)
    second_r = pearson([300, 100, 200], [1.0, 1.0, 0.0])
    assert shape.median_r == pytest.approx((-1.0 + second_r) / 2)
    assert shape.negative_r_share == 0.5  # the second question's r is +0.0
    # Each question's lengths over its own mean, then pooled: right (2/3, 3/2, 1/2) vs
    # wrong (4/3, 1).
    right, wrong = (2 / 3 + 1.5 + 0.5) / 3, (4 / 3 + 1.0) / 2
    assert shape.correct_over_wrong == pytest.approx(right / wrong)
    assert shape.branch_accuracy == pytest.approx(3 / 5)
    assert shape.majority_accuracy == pytest.approx(1.0)  # ties go to the first seen
    assert shape.capped_share == 0.0


def test_capped_rollouts_do_not_vote() -> None:
    looped = [Rollout(10_000, False, answer="5", capped=True) for _ in range(3)]
    shape = rollout_shape([[*looped, Rollout(500, True, answer="4")]])
    assert shape.majority_accuracy == 1.0
    assert shape.capped_share == 0.75


def test_questions_where_everyone_agrees_have_no_correlation() -> None:
    shape = rollout_shape([group((100, True), (200, True))])
    assert math.isnan(shape.median_r) and math.isnan(shape.correct_over_wrong)
    assert math.isnan(shape.negative_r_share)


def test_a_single_rollout_per_question_is_refused() -> None:
    with pytest.raises(ValueError, match="two or more rollouts"):
        rollout_shape([group((100, True))])


def test_misfits_name_the_statistic_and_its_range() -> None:
    shape = rollout_shape([group((100, True), (101, False)), group((100, True), (102, False))])
    misfits = " ".join(shape.misfits())
    low, high = REAL_RANGES["median_spread"]
    assert f"median_spread=1.015 (real range {low:g} .. {high:g})" in misfits
    assert "capped_share=0.000" in misfits
    assert [row[0] for row in shape.rows()][:3] == [
        "questions x rollouts",
        "median length (tokens)",
        "longest (tokens)",
    ]


def test_trace_branches_at_the_cap_or_without_an_answer_are_capped() -> None:
    trace = Trace.of(
        [
            TraceRequest(
                "r",
                0.0,
                "4",
                (
                    BranchScript(length=50, answer="4"),
                    BranchScript(length=99, answer="4"),  # at the cap: cut before its answer
                    BranchScript(length=70, answer=""),  # a recorded branch that wrote none
                ),
            )
        ]
    )
    (rollouts,) = trace_rollouts(trace, max_tokens=99)
    assert [(r.length, r.correct, r.capped) for r in rollouts] == [
        (50, True, False),
        (99, False, True),
        (70, False, True),
    ]
    (uncapped,) = trace_rollouts(trace)
    assert [r.capped for r in uncapped] == [False, False, True]
