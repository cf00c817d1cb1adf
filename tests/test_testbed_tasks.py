"""The testbed task: questions, noisy traces, the exact grader and the step labels."""

from __future__ import annotations

import itertools
import random
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.answers import extract_answer
from sart.errors import ConfigError
from sart.prm.aggregate import split_steps
from sart.testbed.tasks import (
    MAX_DIGITS,
    Question,
    TraceConfig,
    answer_step,
    clean_trace,
    grade,
    join_steps,
    make_questions,
    noisy_trace,
    step_labels,
    step_values,
)

questions = st.lists(st.integers(0, 9), min_size=1, max_size=MAX_DIGITS).map(Question)


def test_import_sart_testbed_does_not_import_torch() -> None:
    import subprocess

    code = "import sart, sart.testbed, sart.testbed.tasks, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_question_format_and_answer() -> None:
    q = Question((3, 7, 5))
    assert q.prompt == "Q 3 p1 7 p2 5 p3 S"
    assert q.answer == "5"
    assert q.running() == [3, 0, 5]
    assert q.difficulty == 3
    assert Question.from_prompt(q.prompt) == q


def test_clean_trace_text() -> None:
    text = clean_trace(Question((3, 7)))
    assert text == "p1 3 + 0 = 3 \n\n p2 7 + 3 = 0 \n\n answer \\boxed{ 0 }"
    assert [s.strip() for s in split_steps(text)] == [
        "p1 3 + 0 = 3",
        "p2 7 + 3 = 0",
        "answer \\boxed{ 0 }",
    ]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("error_carry", {"error_carry": 1.5}),
        ("fix", {"fix": -0.1}),
        ("styles", {"styles": ()}),
        ("max_rechecks", {"max_rechecks": -1}),
    ],
)
def test_trace_config_validation_names_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=field):
        TraceConfig(**kwargs)


def test_question_validation() -> None:
    with pytest.raises(ConfigError, match="digits"):
        Question(())
    with pytest.raises(ConfigError, match="digits"):
        Question((1, 10))
    with pytest.raises(ConfigError, match="digits"):
        Question(range(MAX_DIGITS + 1))


@given(questions)
def test_clean_trace_grades_correct_and_every_step_is_on_track(q: Question) -> None:
    text = clean_trace(q)
    assert grade(q, text)
    assert extract_answer(text) == q.answer
    assert all(step_labels(q, text))
    assert step_values(text)[: q.difficulty] == q.running()


@given(questions, st.data())
def test_an_unfixed_error_grades_wrong_and_labels_stay_off_from_it(
    q: Question, data: st.DataObject
) -> None:
    # A wrong result at step i, carried by the later steps, never fixed.
    i = data.draw(st.integers(0, q.difficulty - 1))
    delta = data.draw(st.integers(1, 9))
    steps, value = [], 0
    for j, d in enumerate(q.digits):
        result = (value + d) % 10
        if j == i:
            result = (result + delta) % 10
        steps.append(f"p{j + 1} {d} + {value} = {result}")
        value = result
    text = join_steps([*steps, answer_step(value)])
    assert not grade(q, text)
    labels = step_labels(q, text)
    assert labels == [True] * i + [False] * (len(labels) - i)


@given(questions, st.integers(0, 2**32 - 1))
def test_noisy_traces_are_well_formed_and_labels_agree_with_the_grader(
    q: Question, seed: int
) -> None:
    text = noisy_trace(q, random.Random(seed))
    steps = split_steps(text)
    assert steps[-1].strip().startswith("answer \\boxed{")
    labels = step_labels(q, text)
    assert len(labels) == len(steps)
    # The answer step's label is the grade, and the value held before the
    # answer is what the answer writes.
    assert labels[-1] == grade(q, text)
    assert extract_answer(text) == str(step_values(text)[-1])
    # Positions advance one at a time; re-checks repeat the previous one.
    positions = [int(s.split()[-6][1:]) for s in steps[:-1]]
    assert positions[0] == 1 and positions[-1] == q.difficulty
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(positions))


def test_noisy_traces_are_noisy_and_reproducible() -> None:
    qs = make_questions(0, 400, difficulties=(6,))
    rng = random.Random(0)
    texts = [noisy_trace(q, rng) for q in qs]
    rng2 = random.Random(0)
    assert texts == [noisy_trace(q, rng2) for q in qs]
    accuracy = sum(grade(q, t) for q, t in zip(qs, texts)) / len(qs)
    assert 0.6 < accuracy < 0.95  # errors happen, and are not the rule
    lengths = [len(t.split(" ")) for t in texts]
    assert max(lengths) >= 1.8 * min(lengths)  # re-check styles spread the lengths
    assert any("wait" in t for t in texts)


def test_a_fixed_error_is_on_track_again() -> None:
    q = Question((6, 6, 1))
    text = join_steps(
        [
            "p1 6 + 0 = 6",
            "p2 6 + 6 = 4",  # wrong (should be 2)
            "wait p2 6 + 6 = 2",  # the re-check fixes it
            "p3 1 + 2 = 3",
            answer_step(3),
        ]
    )
    assert grade(q, text)
    assert step_labels(q, text) == [True, False, True, True, True]


def test_a_step_cut_mid_way_keeps_the_label_before_it() -> None:
    q = Question((6, 6, 1))
    assert step_labels(q, "p1 6 + 0 = 6 \n\n p2 6 +") == [True, True]
    assert step_labels(q, "p1 6 + 0 = 5 \n\n p2 6 +") == [False, False]
    assert step_labels(q, "p1 6 + 0 = 6 \n\n answer \\boxed{") == [True, True]


def test_copy_slips_and_skipped_positions_are_off_track() -> None:
    q = Question((6, 6, 1))
    assert step_labels(q, "p1 6 + 0 = 6 \n\n p2 5 + 6 = 1") == [True, False]
    assert step_labels(q, "p1 6 + 0 = 6 \n\n p3 1 + 6 = 7") == [True, False]
    assert step_labels(q, "p1 6 + 0 = 6 \n\n p2 6 + 5 = 1") == [True, False]


def test_make_questions_cycles_difficulties() -> None:
    qs = make_questions(3, 12, difficulties=(3, 5))
    assert [q.difficulty for q in qs] == [3, 5] * 6
    assert qs == make_questions(3, 12, difficulties=(3, 5))


step_words = st.sampled_from(["p1", "p5", "p8", "wait", "+", "=", "answer", "\\boxed{", "}"])
any_steps = st.lists(
    st.lists(st.one_of(step_words, st.integers(0, 9).map(str)), max_size=8).map(" ".join),
    max_size=10,
)


@given(questions, any_steps)
def test_step_labels_take_any_text(q: Question, steps: list[str]) -> None:
    # Sampled text can be anything: one label per step, never an exception.
    text = join_steps(steps)
    labels = step_labels(q, text)
    assert len(labels) == len(split_steps(text))
    assert len(step_values(text)) == len(labels)
