"""Graders: is a response's answer the gold one? One interface, three graders.

A ``Grader`` has two methods:

- ``extract(response) -> str``: the answer a response gives (``""`` if none),
  for reports and per-sample records;
- ``grade(response, gold) -> bool``: whether that answer is the gold one.

``response`` is a model's text (the whole response; a bare answer works for
``ExactGrader`` and ``ChoiceGrader``, and for ``MathVerifyGrader`` once put in
``\\boxed{}``: see ``sart.eval.mathverify.boxed``).

- ``MathVerifyGrader`` (``"math-verify"``): math-verify's ``parse`` and
  ``verify``, gold first, the gold answer parsed in ``\\boxed{}``; equivalent
  forms (``\\frac12``, ``\\dfrac{1}{2}``, ``0.5``) grade as equal. Bounded in
  time from any thread (``sart.eval.mathverify``). Needs ``sart[eval]``.
- ``ChoiceGrader`` (``"choice"``): the option letter of a multiple-choice
  answer (GPQA): from the last ``\\boxed{B}``, else the last "answer is (B)" /
  "Answer: B", else a last line that is only a letter.
- ``ExactGrader`` (``"exact"``): ``sart.answers.extract_answer(response) ==
  gold``, the testbed's grader (``sart.testbed.grade``).

``make_grader(name)`` builds one by name (the ``grading`` a ``Dataset`` names).
``grade_answer(grader, answer, gold)`` grades an answer already extracted
(what ``sart eval`` records per branch, and what votes count).
Importing this module imports neither math-verify nor sympy.
"""

from __future__ import annotations

import re
from typing import Protocol, runtime_checkable

import attrs

from sart.answers import extract_answer
from sart.errors import ConfigError, config_check
from sart.eval.mathverify import UsesMathVerify, boxed


@runtime_checkable
class Grader(Protocol):
    """Extracts a response's answer and grades it against the gold answer."""

    def extract(self, response: str) -> str:
        """The answer ``response`` gives, ``""`` if none."""
        ...

    def grade(self, response: str, gold: str) -> bool:
        """Whether ``response``'s answer is ``gold``."""
        ...


@attrs.frozen
class ExactGrader:
    """The extracted answer (last ``\\boxed{}``, else last line) equals the gold string."""

    def extract(self, response: str) -> str:
        return extract_answer(response)

    def grade(self, response: str, gold: str) -> bool:
        return extract_answer(response) == gold.strip()


def _check_letters(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    config_check(
        isinstance(value, str)
        and len(value) >= 2
        and len(set(value)) == len(value)
        and value.isalpha()
        and value.isupper(),
        "letters",
        value,
        "two or more distinct capital letters",
    )


_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mathit)\s*\{([^{}]*)\}")


@attrs.frozen
class ChoiceGrader:
    """The option letter a multiple-choice response gives (GPQA's ``A``-``D``)."""

    letters: str = attrs.field(default="ABCD", validator=_check_letters)
    """The option letters."""

    def extract(self, response: str) -> str:
        """The letter in the last ``\\boxed{}`` (``B``, ``(B)``, ``\\text{B}``,
        ``B) 42``), else in the last "answer is (B)", "Answer: B", "option B";
        else a last line that is only a letter (``**B**``); ``""`` if none."""
        letter = f"[{self.letters}]"
        if "\\boxed{" in response:
            content = _WRAPPER.sub(r"\1", extract_answer(response))
            found = re.match(rf"^[\s(\[{{*$]*({letter})(?![A-Za-z0-9])", content)
            if found:
                return found.group(1)
        stated = re.compile(
            rf"(?i:\b(?:answer|option|choice)\b(?:\s+is)?)\s*[:=]?\s*[*$(\[\s]*({letter})"
            rf"(?![A-Za-z0-9])"
        )
        matches = list(stated.finditer(response))
        if matches:
            return matches[-1].group(1)
        for line in reversed(response.splitlines()):
            if line.strip():
                found = re.fullmatch(rf"[\s*(\[.]*({letter})[\s*)\].:]*", line)
                return found.group(1) if found else ""
        return ""

    def grade(self, response: str, gold: str) -> bool:
        wanted = gold.strip().strip("()").upper()
        if len(wanted) != 1 or wanted not in self.letters:
            raise ConfigError(f"gold={gold!r} must be one of the letters {self.letters}")
        return self.extract(response) == wanted


@attrs.frozen
class MathVerifyGrader(UsesMathVerify):
    """Mathematical equivalence: math-verify's ``verify(parse(\\boxed{gold}), parse(response))``
    (``timeout``: a parse or comparison past it grades as wrong)."""

    def extract(self, response: str) -> str:
        """The last ``\\boxed{}``'s content, else the last line (what votes compare)."""
        return extract_answer(response)

    def grade(self, response: str, gold: str) -> bool:
        """math-verify reads ``response`` as a whole (its last ``\\boxed{}`` first, then
        "final answer is ...", then the last LaTeX or number); ``gold`` is boxed."""
        return self._verifier.verify(boxed(gold.strip()), response)


GRADERS: dict[str, type[MathVerifyGrader] | type[ChoiceGrader] | type[ExactGrader]] = {
    "math-verify": MathVerifyGrader,
    "choice": ChoiceGrader,
    "exact": ExactGrader,
}
"""The graders by name (a ``Dataset``'s ``grading``)."""


def make_grader(name: str) -> Grader:
    """The grader named ``name``, with its defaults."""
    kind = GRADERS.get(name)
    if kind is None:
        raise ConfigError(f"grading={name!r} must be one of {', '.join(GRADERS)}")
    return kind()


def grade_answer(grader: Grader, answer: str | None, gold: str) -> bool:
    """Whether an extracted ``answer`` (``grader.extract``'s) is ``gold``: graded as the
    response ``\\boxed{answer}``, so that the grader reads it whole; no answer
    (``None`` or ``""``) is wrong."""
    if not answer:
        return False
    return grader.grade(boxed(answer), gold)


__all__ = [
    "GRADERS",
    "ChoiceGrader",
    "ExactGrader",
    "Grader",
    "MathVerifyGrader",
    "grade_answer",
    "make_grader",
]
