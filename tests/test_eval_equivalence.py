"""Votes by meaning: ``MathVerifyEquivalence`` makes Self-Consistency count equivalent
forms of an answer together, deterministically, whatever the ties."""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sart
from sart.eval import MathVerifyEquivalence, load_dataset
from sart.eval.equivalence import typographic_key
from sart.policies.equivalence import group_answers
from sart.types import BranchStatus
from sart.views import BranchView
from strategies import examples

pytest.importorskip("math_verify", reason="math-verify is not installed (sart[eval])")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

#: One equivalence for the whole module: its parse cache is what a long run would have.
EQUIVALENCE = MathVerifyEquivalence()

values = st.builds(Fraction, st.integers(-30, 30), st.integers(1, 20))


def finite_decimal(value: Fraction) -> str | None:
    """``value`` as an exact decimal, if it has one (denominator 2^a 5^b)."""
    q = value.denominator
    for prime in (2, 5):
        while q % prime == 0:
            q //= prime
    if q != 1:
        return None
    return format(Decimal(value.numerator) / Decimal(value.denominator), "f")


@st.composite
def spellings(draw: st.DrawFn, value: Fraction) -> str:
    """One of the ways a model may write ``value``."""
    p, q = value.numerator, value.denominator
    sign, a = ("-" if p < 0 else ""), abs(p)
    k = draw(st.integers(2, 6))
    forms = [
        f"{sign}\\frac{{{a}}}{{{q}}}",
        f"{sign}\\dfrac{{{a}}}{{{q}}}",
        f"\\frac{{{p}}}{{{q}}}",
        f"{sign}\\tfrac{{{a}}}{{{q}}}",
        f"\\frac{{{k * p}}}{{{k * q}}}",
        f"{sign}\\dfrac{{{k * a}}}{{{k * q}}}",
        f"{p}/{q}",
        f"{sign}\\frac {{ {a} }} {{ {q} }}",
    ]
    if a < 10 and q < 10:
        forms.append(f"{sign}\\frac{a}{q}")  # \frac12
    if q == 1:
        forms.append(str(p))
    decimal = finite_decimal(value)
    if decimal is not None:
        forms.append(decimal)
    return draw(st.sampled_from(forms))


@st.composite
def votes(draw: st.DrawFn, tie: bool = False) -> tuple[list[BranchView], list[str], list[Fraction]]:
    """Completed branches voting for two or three values, each spelled many ways; the
    first value has the most votes (or, with ``tie``, as many as the second)."""
    chosen = draw(st.lists(values, min_size=2, max_size=3, unique=True))
    top = draw(st.integers(2, 5))
    counts = [top, top if tie else draw(st.integers(1, top - 1))]
    counts += [draw(st.integers(1, top - 1)) for _ in chosen[2:]]
    meant = [v for v, c in zip(chosen, counts) for _ in range(c)]
    meant = draw(st.permutations(meant))
    answers = [draw(spellings(v)) for v in meant]
    ends = draw(st.permutations(range(len(meant))))
    views = [BranchView(i, BranchStatus.FINISHED, 10, 0.5, "", e) for i, e in enumerate(ends)]
    return views, answers, meant


@settings(max_examples=examples(30))
@given(votes())
def test_self_consistency_counts_equivalent_spellings_together(
    vote: tuple[list[BranchView], list[str], list[Fraction]],
) -> None:
    views, answers, meant = vote
    groups = group_answers(views, answers, EQUIVALENCE)
    assert len(groups) == len(set(meant))
    for group in groups:
        assert len({meant[b.index] for b in group}) == 1, [answers[b.index] for b in group]
    majority = max(set(meant), key=meant.count)
    select = sart.MajorityVote(equivalence=EQUIVALENCE)
    chosen = select.choose(views, answers)
    assert meant[chosen] == majority
    # Deterministic: the candidates' order and a fresh equivalence change nothing.
    assert select.choose(views[::-1], answers[::-1]) == chosen
    assert sart.MajorityVote(equivalence=MathVerifyEquivalence()).choose(views, answers) == chosen


@settings(max_examples=examples(20))
@given(votes(tie=True))
def test_a_tie_goes_to_the_value_that_completed_first(
    vote: tuple[list[BranchView], list[str], list[Fraction]],
) -> None:
    views, answers, meant = vote
    first = min(views, key=lambda b: b.end_step)
    top = max(meant.count(v) for v in meant)
    tied = {v for v in meant if meant.count(v) == top}
    earliest = min((b for b in views if meant[b.index] in tied), key=lambda b: b.end_step)
    chosen = sart.MajorityVote(equivalence=EQUIVALENCE).choose(views, answers)
    assert chosen == earliest.index  # the first-completed branch of the tied value
    if meant[first.index] in tied:
        assert chosen == first.index
    # The weighted vote (equal rewards here) agrees, and picks that value too.
    weighted = sart.WeightedVote(equivalence=EQUIVALENCE).choose(views, answers)
    assert meant[weighted] == meant[chosen]


def test_exact_match_splits_what_math_verify_joins() -> None:
    views = [BranchView(i, BranchStatus.FINISHED, 10, 0.5, "", i) for i in range(5)]
    answers = ["3", "\\frac12", "0.5", "\\dfrac{2}{4}", "3"]
    assert sart.MajorityVote().choose(views, answers) == 0  # "3" twice
    assert sart.MajorityVote(equivalence=EQUIVALENCE).choose(views, answers) == 1  # 1/2 x three


def test_typographic_keys_fold_only_typography() -> None:
    assert typographic_key(" \\dfrac{1}{2} ") == typographic_key("\\frac{1}{2}") == "\\frac{1}{2}"
    assert typographic_key("\\left( 3,  \\tfrac{\\pi}{2} \\right)") == "( 3, \\frac{\\pi}{2} )"
    assert typographic_key("10,\\!080") == "10,080"
    assert typographic_key("\\left. x \\right|_{0}") == " x |_{0}".strip()
    assert typographic_key("\\leftarrow") == "\\leftarrow"  # not \left
    assert typographic_key("\\dfracx") == "\\dfracx"


def test_equal_keys_are_equal_to_math_verify_on_math500() -> None:
    path = SHARED_DATA / "math500" / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent: the real benchmark files live beside the project")
    for gold in (p.answer for p in load_dataset("math500", path)):
        spelled = re.sub(r"\\frac", r"\\dfrac", gold).replace(" ", "  ")
        assert EQUIVALENCE.key(spelled) == EQUIVALENCE.key(gold)
        assert EQUIVALENCE.same(gold, spelled), gold


def test_same_is_math_verify_gold_first() -> None:
    # An assignment's right side is its value when the gold is a number, not the other way.
    assert EQUIVALENCE.same("5", "x=5") and EQUIVALENCE.same("x=5", "5")
    assert EQUIVALENCE.same("0", "5x - 7y + 11z + 4 = 0")
    assert not EQUIVALENCE.same("5x - 7y + 11z + 4 = 0", "0")
