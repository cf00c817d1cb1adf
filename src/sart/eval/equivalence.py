"""Votes that count answers by meaning: ``MathVerifyEquivalence`` for the selectors.

Pass it to a vote::

    MajorityVote(equivalence=MathVerifyEquivalence())
    WeightedVote(equivalence=MathVerifyEquivalence())

and ``\\frac{1}{2}``, ``\\dfrac12``, ``\\frac{2}{4}`` and ``0.5`` are one answer.
``key`` first folds what is only typography (``\\dfrac``/``\\tfrac`` to
``\\frac``, ``\\left``/``\\right``, the ``\\!`` thin space, runs of
whitespace), so identical answers cost a dict lookup; ``same(a, b)`` then asks
math-verify whether ``b`` is ``a``, with ``a`` the representative of a group
already formed (first seen in completion order). Each answer is parsed once
per process (a cache), and compared with at most one representative per group.

The grouping is deterministic: the votes place answers in completion order,
and math-verify is a pure function of the two texts, except that a parse or
comparison past ``timeout`` counts as different. Cost: see
``docs/how-to/grading.md``.
"""

from __future__ import annotations

import re

import attrs

from sart.errors import ConfigError
from sart.eval.mathverify import UsesMathVerify, boxed, require_math_verify
from sart.policies.equivalence import Equivalence, ExactMatch

_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
# \left. and \right. are invisible delimiters: the dot goes with them.
_DELIMITER_SIZE = re.compile(r"\\(?:left|right)(?![A-Za-z])\.?")
_SPACE = re.compile(r"\s+")


def typographic_key(answer: str) -> str:
    """``answer`` without typography that cannot change its meaning: ``\\dfrac`` and
    ``\\tfrac`` as ``\\frac``, no ``\\left``/``\\right``, no ``\\!``, whitespace runs
    as one space, no outer whitespace."""
    text = _FRAC.sub(r"\\frac", answer)
    text = _DELIMITER_SIZE.sub("", text).replace("\\!", "")
    return _SPACE.sub(" ", text).strip()


@attrs.frozen
class MathVerifyEquivalence(UsesMathVerify, Equivalence):
    """Answers are the same when math-verify verifies one against the other
    (``timeout``: a parse or comparison past it counts as different)."""

    def key(self, answer: str) -> str:
        return typographic_key(answer)

    def same(self, a: str, b: str) -> bool:
        return self._verifier.verify(boxed(a), boxed(b))


#: What ``--equivalence`` may name: how ``sart serve`` and ``sart bench`` group answers
#: in votes and agreement stops.
EQUIVALENCES = ("exact", "math-verify")


def named_equivalence(name: str) -> Equivalence:
    """The equivalence ``--equivalence NAME`` names: ``exact`` (``ExactMatch``, the
    policies' own) or ``math-verify`` (``MathVerifyEquivalence``; math-verify is
    imported now, so a missing ``[eval]`` extra is said at start, not at a vote)."""
    if name == "exact":
        return ExactMatch()
    if name == "math-verify":
        require_math_verify()
        return MathVerifyEquivalence()
    raise ConfigError(f"equivalence={name!r} must be one of {list(EQUIVALENCES)}")


__all__ = ["EQUIVALENCES", "MathVerifyEquivalence", "named_equivalence", "typographic_key"]
