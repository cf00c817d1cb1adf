"""The calibration report: its statistics, and the shipped weights' numbers pinned."""

from __future__ import annotations

import json
import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.errors import ConfigError
from sart.rollouts import auroc, cv, majority, pearson
from sart.testbed.report import Branch, Calibration, ReportConfig, summarize


def test_auroc_known_values() -> None:
    assert auroc([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == 1.0
    assert auroc([0.1, 0.2, 0.9, 0.8], [True, True, False, False]) == 0.0
    assert auroc([0.5, 0.5, 0.5], [True, False, True]) == 0.5  # ties count half
    assert auroc([0.3, 0.7, 0.5], [True, True, False]) == 0.5
    assert math.isnan(auroc([0.1, 0.2], [True, True]))


@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=2))
def test_auroc_is_a_probability_and_flips_with_the_labels(pairs: list) -> None:
    scores = [s for s, _ in pairs]
    labels = [y for _, y in pairs]
    a = auroc(scores, labels)
    if math.isnan(a):
        assert all(labels) or not any(labels)
        return
    assert 0.0 <= a <= 1.0
    assert auroc(scores, [not y for y in labels]) == pytest.approx(1.0 - a)


def test_pearson_cv_majority() -> None:
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1, 1, 1], [0, 1, 0]))
    assert cv([10, 10]) == 0.0
    assert cv([5, 15]) == pytest.approx(0.5)
    assert majority(["3", "4", "4", "3"]) == "3"  # a tie goes to the first seen
    assert majority(["1", "2", "2"]) == "2"


def _branch(q: int, length: int, correct: bool, reward: float) -> Branch:
    return Branch(q, 3, length, "1" if correct else "2", correct, True, (reward,), (reward,))


def test_summarize_on_hand_made_branches() -> None:
    branches = [
        _branch(0, 10, True, 0.9),
        _branch(0, 30, False, 0.2),
        _branch(1, 20, False, 0.8),
        _branch(1, 20, True, 0.7),
    ]
    c = summarize(branches, n=2, seed=0, aggregation="last")
    assert c.questions == 2
    assert c.branch_accuracy == 0.5
    assert c.median_longest_over_shortest == pytest.approx((3 + 1) / 2)
    assert c.mean_within_question_r == pytest.approx(-1.0)  # only question 0 has both
    assert c.best_of_n_accuracy["last"] == 0.5  # right on q0, wrong on q1
    assert c.majority_accuracy == 0.5  # ties go to the first branch: right, then wrong
    assert c.oracle_accuracy == 1.0
    assert c.auroc_full["last"] == 0.75
    assert "branch accuracy" in c.text() and c.to_json()["n"] == 2
    assert Calibration.from_json(json.loads(json.dumps(c.to_json()))) == c


def long_calibration(**changes: object) -> object:
    """A hand-made long-testbed calibration inside every range, with ``changes``."""
    branches = [_branch(q, 400 + 100 * i, i < 4, 0.1 * i) for q in range(4) for i in range(8)]
    c = summarize(branches, n=8, seed=0, aggregation="last", testbed="testbed-long")
    fits = dict(
        median_length=600.0,
        longest=2048,
        median_length_cv=0.3,
        median_longest_over_shortest=2.5,
        median_within_question_r=-0.2,
        capped_share=0.03,
        branch_accuracy=0.55,
        majority_accuracy=0.7,
        accuracy_by_difficulty={24: 0.7, 64: 0.4},
        auroc_half={"last": 0.75},
        best_of_n_accuracy={"last": 0.8},
    )
    return attrs.evolve(c, **{**fits, **changes})


def test_the_long_testbeds_ranges_and_relations() -> None:
    assert long_calibration().misfits() == []
    assert "every number in the long testbed's ranges" in long_calibration().text()
    cases = {
        "median_length=300.000 (range 400 .. 1000)": {"median_length": 300.0},
        "median_within_question_r=0.050": {"median_within_question_r": 0.05},
        "capped_share=0.000": {"capped_share": 0.0},
        "not: majority >= branch + 0.1": {"majority_accuracy": 0.6},
        "not: accuracy falls with difficulty": {"accuracy_by_difficulty": {24: 0.4, 64: 0.5}},
        "not: PRM AUROC at 50% (last) >= 0.7": {"auroc_half": {"last": 0.65}},
        "not: best of 8 by PRM (last) > majority": {"best_of_n_accuracy": {"last": 0.7}},
    }
    for message, change in cases.items():
        c = long_calibration(**change)
        assert any(m.startswith(message) for m in c.misfits()), (message, c.misfits())
        assert message in c.text()
    # The short testbed has printed targets, not ranges.
    short = attrs.evolve(long_calibration(median_length=1.0), testbed="testbed")
    assert short.misfits() == [] and "(target 0.2-0.5)" in short.text()


def test_a_report_of_the_long_testbed_takes_its_questions_and_cap() -> None:
    config = ReportConfig.of("testbed-long", questions=5)
    assert config.difficulties == (24, 32, 40, 48, 56, 64)
    assert (config.max_new_tokens, config.questions) == (2048, 5)
    assert ReportConfig.of("testbed") == ReportConfig(testbed="testbed")
    with pytest.raises(ConfigError, match="testbed='mini'"):
        ReportConfig(testbed="mini")


def test_report_config_validation() -> None:
    with pytest.raises(ConfigError, match="n=1"):
        ReportConfig(n=1)
    with pytest.raises(ConfigError, match="questions"):
        ReportConfig(questions=0)


# --------------------------------------------------------------------------- shipped weights


@pytest.fixture(scope="module")
def calibration():
    pytest.importorskip("transformers")
    from sart.testbed.report import calibrate

    # The full report (120 questions x 8 branches, seed 0): about 10 s.
    return calibrate(ReportConfig(n=8, questions=120, seed=0))


def test_shipped_policy_meets_the_calibration_targets(calibration) -> None:
    c = calibration
    # Length spread, weak length-correctness link, mid accuracy, harder with
    # more digits, and errors that a vote of 8 mostly outvotes.
    assert 0.2 <= c.median_length_cv <= 0.5
    assert 1.8 <= c.median_longest_over_shortest <= 4.0
    assert abs(c.mean_within_question_r) <= 0.3
    assert abs(c.pooled_within_question_r) <= 0.3
    assert 0.4 <= c.branch_accuracy <= 0.8
    accuracy = [c.accuracy_by_difficulty[k] for k in range(3, 9)]
    assert accuracy[0] > accuracy[-1] + 0.2
    assert c.finished_share > 0.95
    assert c.majority_accuracy > c.branch_accuracy + 0.1


def test_shipped_prm_meets_the_calibration_targets(calibration) -> None:
    c = calibration
    agg = c.aggregation
    # Informative half-way (pruning at 50% of a trace is mostly right)...
    assert c.auroc_half[agg] >= 0.75
    # ...but not an oracle: some right traces rank below wrong ones even when
    # finished, and more so half-way.
    assert c.auroc_half[agg] < 0.85
    assert c.auroc_full[agg] <= 0.97
    # Best-of-8 by reward clearly beats one branch.
    assert c.best_of_n_accuracy[agg] >= c.branch_accuracy + 0.15


def test_report_is_deterministic() -> None:
    pytest.importorskip("transformers")
    from sart.testbed.report import calibrate

    config = ReportConfig(n=4, questions=12, seed=3)
    assert calibrate(config) == calibrate(config)
