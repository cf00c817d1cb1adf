"""The testbed task: questions, noisy traces, the exact grader and the step labels."""

from __future__ import annotations

import hashlib
import itertools
import random
import statistics
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.answers import extract_answer
from sart.errors import ConfigError
from sart.prm.aggregate import split_steps
from sart.testbed.tasks import (
    MAX_DIGITS,
    MAX_POSITIONS,
    MAX_ROUNDS,
    STEP_WORD,
    Question,
    TraceConfig,
    answer_step,
    clean_trace,
    grade,
    join_steps,
    make_question,
    make_questions,
    noisy_response,
    noisy_trace,
    step_labels,
    step_values,
)

digit_lists = st.lists(st.integers(0, 9), min_size=1, max_size=MAX_DIGITS)
# Plain questions (the short testbed's) and cycled ones (the long testbed's).
questions = st.one_of(
    digit_lists.map(Question),
    st.builds(lambda d, r: Question(d, rounds=r), digit_lists, st.integers(1, MAX_ROUNDS)),
)


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
        ("systematic", {"systematic": 2.0}),
        ("doubt", {"doubt": -0.5}),
        ("loop_tokens", {"loop_tokens": 0}),
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
        Question([1] * (MAX_POSITIONS + 1))
    assert Question([1] * MAX_POSITIONS).prompt.split()[-2] == f"p{MAX_POSITIONS}"


@given(questions)
def test_clean_trace_grades_correct_and_every_step_is_on_track(q: Question) -> None:
    text = clean_trace(q)
    assert grade(q, text)
    assert extract_answer(text) == q.answer
    assert all(step_labels(q, text))
    arithmetic = ["+" in s for s in split_steps(text)]
    assert [v for v, a in zip(step_values(text), arithmetic) if a] == q.running()


@given(questions, st.data())
def test_an_unfixed_error_grades_wrong_and_labels_stay_off_from_it(
    q: Question, data: st.DataObject
) -> None:
    # A wrong result at step i, carried by the later steps, never fixed.
    i = data.draw(st.integers(0, q.difficulty - 1))
    delta = data.draw(st.integers(1, 9))
    steps, value, before = [], 0, 0  # before: the steps before addition i
    for j, (marker, position, d) in enumerate(q.walk()):
        before = len(steps) if j == i else before
        result = (value + d) % 10
        if j == i:
            result = (result + delta) % 10
        steps.append(f"{marker + ' ' if marker else ''}p{position} {d} + {value} = {result}")
        value = result
    text = join_steps([*steps, answer_step(value)])
    assert not grade(q, text)
    labels = step_labels(q, text)
    assert labels == [True] * before + [False] * (len(labels) - before)


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
    # Positions advance one at a time, starting over after a round's last; re-checks
    # repeat the previous one; a cycled question's steps count its rounds down.
    arithmetic = [s.split() for s in steps[:-1]]
    positions = [int(words[-6][1:]) for words in arithmetic]
    width = len(q.digits)
    assert positions[0] == 1 and positions[-1] == width
    assert all((b - a) % width in (0, 1) for a, b in itertools.pairwise(positions))
    counts = [w for words in arithmetic for w in words if w[0] == "r"]
    assert len(counts) == (len(arithmetic) if q.rounds else 0)
    assert [k for k, _ in itertools.groupby(counts)] == [
        f"r{k}" for k in range(q.rounds or 0, 0, -1)
    ]
    starts = [p == 1 and (i == 0 or positions[i - 1] == width) for i, p in enumerate(positions)]
    assert all(a == b or start for a, b, start in zip(counts, counts[1:], starts[1:]))


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


def test_the_short_testbeds_traces_are_those_its_weights_were_trained_on() -> None:
    # The long testbed's settings draw nothing when unset: the default config's traces
    # are the ones the shipped short weights learned (pinned from before they existed).
    rng = random.Random(7)
    texts = [noisy_trace(q, rng) for q in make_questions(3, 50)]
    digest = hashlib.sha256("|".join(texts).encode()).hexdigest()
    assert digest == SHORT_TRACES_DIGEST


#: Recorded at cb0e7b4, before the long testbed's settings existed.
SHORT_TRACES_DIGEST = "da9ec867a02f19d7a07cefc82e6e49fcd2b33cc2e7daa8259513e6e98655a8a9"

LONG = TraceConfig(systematic=1.0, doubt=0.5, loop=0.5, loop_tokens=300, error_carry=0.5)


def test_long_settings_make_errors_repeat_wrong_traces_longer_and_loops() -> None:
    rng = random.Random(0)
    qs = make_questions(1, 400, difficulties=(20,))
    drawn = [(q, *noisy_response(q, rng, LONG)) for q in qs]
    loops = [(q, t) for q, t, done in drawn if not done]
    ended = [(q, t) for q, t, done in drawn if done]
    assert loops and ended
    for _q, text in loops:
        # No answer; the whole steps since the last step taken all re-check it,
        # unchanged, and the loop's last loop_tokens words are nothing else.
        words = text.split(" ")
        assert "answer" not in words
        steps = [s.strip() for s in split_steps(text)][:-1]
        taken = max(i for i, s in enumerate(steps) if not s.startswith("wait "))
        assert {s.removeprefix("wait ") for s in steps[taken:]} == {steps[taken]}
        assert set(words[-300:]) <= {STEP_WORD, "wait", *steps[taken].split(" ")}
    # A finished trace answers the value its last step holds, errors included.
    for _q, text in ended:
        values = [v for v in step_values(text) if v is not None]
        assert extract_answer(text) == str(values[-1])
    right = [len(t.split(" ")) for q, t in ended if grade(q, t)]
    wrong = [len(t.split(" ")) for q, t in ended if not grade(q, t)]
    assert right and wrong
    assert statistics.mean(wrong) > 1.1 * statistics.mean(right)  # over-thinking


def test_coupled_traces_that_hesitate_are_the_ones_that_slip() -> None:
    # Two kinds of trace: careful (no re-checks, no errors) and sloppy (re-checks
    # often, errs often). Coupled, a trace without a re-check is a clean one;
    # drawn apart, some traces err without re-checking.
    kinds = {"styles": (0.0, 0.7), "sloppiness": (0.0, 8.0), "recheck_after_error": 0.0}
    qs = make_questions(2, 200, difficulties=(12,))
    for coupled, expect_clean in ((True, True), (False, False)):
        rng = random.Random(0)
        config = TraceConfig(coupled=coupled, **kinds)
        calm = [(q, t) for q in qs for t, _ in [noisy_response(q, rng, config)] if "wait" not in t]
        assert calm
        assert all(t == clean_trace(q) for q, t in calm) is expect_clean


def test_coupled_needs_one_sloppiness_per_style() -> None:
    with pytest.raises(ConfigError, match="sloppiness"):
        TraceConfig(coupled=True, styles=(0.1, 0.2), sloppiness=(1.0, 2.0, 3.0))


def test_systematic_errors_are_one_more_than_the_right_result() -> None:
    config = TraceConfig(systematic=1.0, error_carry=1.0, error_plain=1.0, styles=(0.0,))
    q = Question([3, 4])
    text, done = noisy_response(q, random.Random(0), config)
    assert done and split_steps(text)[0].strip() == "p1 3 + 0 = 4"


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


def test_a_cycled_question_adds_its_digits_round_after_round() -> None:
    q = Question((3, 7), rounds=2)
    assert (q.difficulty, q.sequence, q.answer) == (4, (3, 7, 3, 7), "0")
    assert q.prompt == "Q 3 p1 7 p2 r2 S"
    assert Question.from_prompt(q.prompt) == q
    assert Question.from_prompt(Question((3, 7)).prompt) == Question((3, 7))
    assert clean_trace(q) == join_steps(
        ["r2 p1 3 + 0 = 3", "r2 p2 7 + 3 = 0", "r1 p1 3 + 0 = 3", "r1 p2 7 + 3 = 0", answer_step(0)]
    )
    with pytest.raises(ConfigError, match="rounds"):
        Question((1,), rounds=MAX_ROUNDS + 1)


def test_cycled_labels_follow_the_addition_not_the_position() -> None:
    q = Question((3, 5), rounds=2)  # running values 3, 8, 1, 6
    first = ["r2 p1 3 + 0 = 3", "r2 p2 5 + 3 = 8"]
    assert all(step_labels(q, join_steps([*first, "r1 p1 3 + 8 = 1", "r1 p2 5 + 1 = 6"])))
    # Round 2 restarts the position, not the running value.
    restarted = join_steps([*first, "r1 p1 3 + 0 = 3", "r1 p2 5 + 3 = 8", answer_step(8)])
    assert step_labels(q, restarted) == [True] * 2 + [False] * 3
    # A re-check that fixes round 2's slip is on track again.
    fixed = [*first, "r1 p1 3 + 8 = 2", "wait r1 p1 3 + 8 = 1", "r1 p2 5 + 1 = 6"]
    assert step_labels(q, join_steps(fixed)) == [True] * 2 + [False, True, True]
    # Skipping round 2's first position, miscounting the rounds left, or answering a
    # round early, is off track.
    assert step_labels(q, join_steps([*first, "r1 p2 5 + 8 = 3"]))[-1] is False
    assert step_labels(q, join_steps([*first, "r2 p1 3 + 8 = 1"]))[-1] is False
    assert step_labels(q, join_steps([*first, "p1 3 + 8 = 1"]))[-1] is False
    assert step_labels(q, join_steps([*first, answer_step(8)]))[-1] is False


def test_make_question_with_a_cycle_covers_the_difficulty_in_rounds() -> None:
    rng = random.Random(0)
    shapes = {d: make_question(rng, d, cycle=8) for d in (4, 8, 9, 13, 24, 30, 64)}
    assert {d: (len(q.digits), q.rounds) for d, q in shapes.items()} == {
        4: (4, 1),
        8: (8, 1),
        9: (5, 2),
        13: (7, 2),
        24: (8, 3),
        30: (8, 4),
        64: (8, 8),
    }
    # Without a cycle, the questions (and the draws) are the short testbed's.
    drawn = random.Random(5)
    assert make_question(random.Random(5), 6) == Question(drawn.randrange(10) for _ in range(6))


def test_make_questions_cycles_difficulties() -> None:
    qs = make_questions(3, 12, difficulties=(3, 5))
    assert [q.difficulty for q in qs] == [3, 5] * 6
    assert qs == make_questions(3, 12, difficulties=(3, 5))


def test_excluded_questions_are_drawn_again_at_their_difficulty() -> None:
    # One digit: ten questions per difficulty, so a seeded set repeats some.
    drawn = make_questions(0, 40, difficulties=(1, 2))
    held = {q.prompt for q in drawn[:6]}
    kept = make_questions(0, 40, difficulties=(1, 2), exclude=held)
    assert not held & {q.prompt for q in kept}
    assert [q.difficulty for q in kept] == [1, 2] * 20
    # Prefix-stable: the first k of a larger set are the set of k.
    assert make_questions(0, 10, difficulties=(1, 2), exclude=held) == kept[:10]


step_words = st.sampled_from(
    ["p1", "p5", "p8", "r1", "r3", "wait", "+", "=", "answer", "\\boxed{", "}"]
)
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
