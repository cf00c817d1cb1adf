"""Graders: math-verify on the real MATH-500 answers (each verifies against itself and
its rewrites, not against other problems' answers), from threads too; option letters;
the testbed's exact grader."""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path

import pytest

from sart.errors import ConfigError, MissingDependencyError
from sart.eval import (
    DATASETS,
    ChoiceGrader,
    ExactGrader,
    Grader,
    MathVerifyGrader,
    load_dataset,
    make_grader,
)
from sart.eval.mathverify import CallTimedOut, MathVerify, _Worker, boxed

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

needs_math_verify = pytest.mark.skipif(
    find_spec("math_verify") is None, reason="math-verify is not installed (sart[eval])"
)


def math500_answers() -> list[str]:
    path = SHARED_DATA / "math500" / "test.jsonl"
    if not path.is_file():
        pytest.skip(
            f"{path} is absent: the real benchmark files live beside the project "
            "(../shared/data), not in a clone of it"
        )
    return [p.answer for p in load_dataset("math500", path)]


def rewrites(answer: str) -> Iterator[tuple[str, str]]:
    """``(name, response)``: responses whose answer is ``answer``, written another way.
    Only rewrites that cannot change the meaning (no comma games: ``58,500``)."""
    yield "sentence", f"So the final answer is $\\boxed{{{answer}}}$."
    yield "boxed", f"\\boxed{{{answer}}}"
    yield "dfrac", boxed(re.sub(r"\\[dt]?frac", r"\\dfrac", answer))
    yield "frac", boxed(re.sub(r"\\[dt]frac", r"\\frac", answer))
    yield "spaces", f"\\boxed{{  {answer.replace(' ', '  ')} }}"
    yield "no left/right", boxed(re.sub(r"\\(?:left|right)(?![A-Za-z])", "", answer))
    yield "inline math", f"The answer is ${answer}$"


# -------------------------------------------------------------------- math-verify


@pytest.fixture(scope="module")
def grader() -> Iterator[MathVerifyGrader]:
    grader = MathVerifyGrader()
    yield grader
    grader.close()


def check_rewrites(grader: MathVerifyGrader, answers: list[str]) -> list[tuple[int, str, str]]:
    return [
        (i, name, response)
        for i, gold in enumerate(answers)
        for name, response in rewrites(gold)
        if not grader.grade(response, gold)
    ]


@needs_math_verify
def test_every_math500_answer_verifies_against_itself(grader: MathVerifyGrader) -> None:
    answers = math500_answers()
    failed = [(i, a) for i, a in enumerate(answers) if not grader.grade(boxed(a), a)]
    assert failed == [], f"{len(answers) - len(failed)}/500 verify against themselves"
    # ...and not merely as equal strings: the sympy forms verify too.
    mv = pytest.importorskip("math_verify")
    parsed = [mv.parse(boxed(a)) for a in answers]
    assert all(mv.verify(p[0], p[0]) for p in parsed)
    assert all(not isinstance(p[0], str) for p in parsed)  # every gold answer parses


@needs_math_verify
def test_math500_answers_verify_against_their_rewrites(grader: MathVerifyGrader) -> None:
    answers = math500_answers()
    assert check_rewrites(grader, random.Random(0).sample(answers, 100)) == []


@pytest.mark.slow
@needs_math_verify
def test_all_math500_answers_verify_against_their_rewrites(grader: MathVerifyGrader) -> None:
    assert check_rewrites(grader, math500_answers()) == []


#: The pairs of *different* MATH-500 answer strings that math-verify verifies, one way or
#: both (all 90 300 ordered pairs: ``python benchmarks/math500_agreement.py``): one answer
#: written two ways (spaces, ``\\frac14``, ``10,\\!080``, units, degrees, dollars, a set
#: in any order, ``x=5``), and two conventions of math-verify's: an equation's right
#: side (gold ``0`` accepts the plane ``5x - 7y + 11z + 4 = 0``) and a base's subscript
#: dropped (``40_9`` is ``40``).
SAME_TO_MATH_VERIFY = {
    frozenset(pair)
    for pair in [
        ("(-2,1)", "-2,1"),
        ("-2,1", "1,-2"),
        ("1,-2", "(-2,1)"),
        ("0", "5x - 7y + 11z + 4 = 0"),
        ("10,\\!080", "10080"),
        ("120", "120^\\circ"),
        ("15", "15\\mbox{ cm}^2"),
        ("2 \\sqrt{5}", "2\\sqrt{5}"),
        ("30", "30^\\circ"),
        ("36", "36^\\circ"),
        ("36", "\\$36"),
        ("36^\\circ", "\\$36"),
        ("40", "40_9"),
        ("5", "x=5"),
        ("90", "90^\\circ"),
        ("\\frac14", "\\frac{1}{4}"),
    ]
}


def cross_pairs(answers: list[str], count: int, seed: int) -> list[tuple[str, str]]:
    """Pairs of different problems' answers that differ in meaning too."""
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < count:
        a, b = rng.sample(answers, 2)
        if a != b and frozenset((a, b)) not in SAME_TO_MATH_VERIFY:
            pairs.append((a, b))
    return pairs


@needs_math_verify
def test_the_listed_same_meaning_pairs_do_verify(grader: MathVerifyGrader) -> None:
    for a, b in map(tuple, SAME_TO_MATH_VERIFY):
        assert grader.grade(boxed(b), a) or grader.grade(boxed(a), b), (a, b)


@needs_math_verify
def test_math500_answers_do_not_verify_against_other_answers(grader: MathVerifyGrader) -> None:
    pairs = cross_pairs(math500_answers(), 300, seed=0)
    assert [(a, b) for a, b in pairs if grader.grade(boxed(b), a)] == []


@pytest.mark.slow
@needs_math_verify
def test_many_math500_answer_pairs_do_not_verify(grader: MathVerifyGrader) -> None:
    pairs = cross_pairs(math500_answers(), 5000, seed=1)
    assert [(a, b) for a, b in pairs if grader.grade(boxed(b), a)] == []


@needs_math_verify
def test_math_verify_reads_whole_responses(grader: MathVerifyGrader) -> None:
    response = "First $x = 3$.\n\nThen we halve: $\\boxed{\\dfrac{3}{2}}$."
    assert grader.grade(response, "\\frac32") and grader.grade(response, "1.5")
    assert not grader.grade(response, "3")
    assert grader.extract(response) == "\\dfrac{3}{2}"
    assert not grader.grade("I do not know.", "3")
    assert grader.grade("The final answer is 12.", "12")
    assert grader.grade(response, "$\\frac{3}{2}$")  # a gold answer with its own delimiters


def test_boxed_leaves_delimited_text_alone() -> None:
    assert boxed("\\frac12") == "\\boxed{\\frac12}"
    assert boxed("\\$18.90") == "\\boxed{\\$18.90}"  # an escaped dollar is not a delimiter
    assert boxed("$x$") == "$x$" and boxed("so \\boxed{2}") == "so \\boxed{2}"


@needs_math_verify
def test_grading_from_threads_agrees_with_the_main_thread(grader: MathVerifyGrader) -> None:
    cases = [("\\boxed{0.5}", "\\frac12"), ("\\boxed{\\dfrac{2}{4}}", "0.5"), ("\\boxed{3}", "2")]
    cases += [(f"\\boxed{{{k}/{2 * k}}}", "\\frac{1}{2}") for k in range(1, 9)]
    expected = [grader.grade(response, gold) for response, gold in cases]
    assert expected == [True, True, False] + [True] * 8
    threaded = MathVerifyGrader(workers=2)
    try:
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda case: threaded.grade(*case), cases)) == expected
    finally:
        threaded.close()


@needs_math_verify
def test_a_timed_out_call_grades_as_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    verifier = MathVerify(timeout=1)

    def too_slow(*_args: object) -> bool:
        raise CallTimedOut("took too long")

    monkeypatch.setattr(verifier._worker, "call", too_slow)
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(verifier.verify("\\boxed{1}", "1")))
    thread.start()
    thread.join()
    assert results == [False]
    assert verifier.verify("\\boxed{1}", "1")  # the main thread does not use the worker
    assert verifier.deadline == 6 * 1 + 10


def test_a_worker_past_its_deadline_is_replaced_and_waiting_calls_go_on() -> None:
    worker = _Worker(processes=1)
    try:
        assert worker.call(abs, (-3,), deadline=60) == 3  # starts the worker (a spawn)
        outcome: dict[str, object] = {}

        def innocent() -> None:
            time.sleep(0.2)  # queued behind the sleeper in the one worker process
            outcome["innocent"] = worker.call(abs, (-4,), deadline=60)

        bystander = threading.Thread(target=innocent)
        bystander.start()
        start = time.monotonic()
        with pytest.raises(CallTimedOut, match="sleep took over 1 s"):
            worker.call(time.sleep, (30,), deadline=1)
        assert time.monotonic() - start < 10
        bystander.join(60)
        assert outcome == {"innocent": 4}  # resubmitted to the new worker
        assert worker.call(abs, (-5,), deadline=60) == 5
    finally:
        worker.close()


def test_math_verify_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="timeout=0 must be a whole number of seconds >= 1"):
        MathVerify(timeout=0)
    with pytest.raises(ConfigError, match=r"timeout=1\.5 must be a whole number"):
        MathVerifyGrader(timeout=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="workers=0 must be >= 1"):
        MathVerifyGrader(workers=0)


def test_without_math_verify_grading_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(MissingDependencyError, match=r"'\.\[eval\]'"):
        MathVerifyGrader().grade("\\boxed{41}", "a gold answer no test parsed before")


# ------------------------------------------------------------------ option letters


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("Thinking...\n\nSo the answer is \\boxed{B}.", "B"),
        ("\\boxed{(C)}", "C"),
        ("\\boxed{\\text{D}}", "D"),
        ("\\boxed{\\textbf{(A)} 42}", "A"),
        ("\\boxed{B) 3.2 eV}", "B"),
        ("First \\boxed{A}, then on reflection \\boxed{C}", "C"),
        ("The answer is (B).", "B"),
        ("the correct answer is C because...", "C"),
        ("Answer: D", "D"),
        ("**Answer:** A", "A"),
        ("I pick option B, final.", "B"),
        ("Reasoning.\n\n**C**\n", "C"),
        ("Reasoning.\n(D)", "D"),
        ("\\boxed{42} but the answer is A", "A"),  # no letter in the box
        ("Both options fail.", ""),
        ("The answer is a mystery.", ""),  # lowercase: not an option letter
        ("Answer: E", ""),
        ("", ""),
    ],
)
def test_choice_grader_finds_the_option_letter(response: str, letter: str) -> None:
    grader = ChoiceGrader()
    assert grader.extract(response) == letter
    assert grader.grade(response, "B") is (letter == "B")


def test_choice_grader_checks_its_letters_and_the_gold_one() -> None:
    assert ChoiceGrader(letters="ABCDE").extract("Answer: E") == "E"
    assert ChoiceGrader().grade("\\boxed{A}", " (a) ")
    with pytest.raises(ConfigError, match="gold='E' must be one of the letters ABCD"):
        ChoiceGrader().grade("\\boxed{A}", "E")
    with pytest.raises(ConfigError, match="letters='AA' must be two or more distinct capital"):
        ChoiceGrader(letters="AA")


# ------------------------------------------------------------------------- exact


def test_exact_grader_is_the_testbeds_grader() -> None:
    from sart.testbed import tasks

    rng = random.Random(0)
    agreed = set()
    for _ in range(200):
        question = tasks.make_question(rng, rng.randint(1, tasks.MAX_DIGITS))
        text = tasks.noisy_trace(question, rng)
        verdict = ExactGrader().grade(text, question.answer)
        assert verdict == tasks.grade(question, text)
        agreed.add(verdict)
    assert agreed == {True, False}  # both verdicts were exercised
    assert ExactGrader().extract("x\n\\boxed{ 7 }") == "7"
    assert ExactGrader().grade("x\n\\boxed{ 7 }", " 7")
    assert not ExactGrader().grade("\\boxed{0.5}", "\\frac12")  # exact: no meaning


# -------------------------------------------------------------------- by name


def test_every_dataset_names_a_grader_that_exists() -> None:
    for spec in DATASETS.values():
        assert isinstance(make_grader(spec.grading), Grader)
    assert isinstance(make_grader("math-verify"), MathVerifyGrader)
    with pytest.raises(ConfigError, match="grading='fuzzy' must be one of math-verify, choice"):
        make_grader("fuzzy")
