"""Accuracy of one method at one ``N``, its 95% interval, and whether two runs agree.

``EvalRun`` is a ``RunRecord`` (the requests as served, on the simulator or
for real) with each request graded by the dataset's grader; its accuracy
counts a failed request as wrong. ``wilson_interval`` is the Wilson score
interval of a binomial proportion: unlike the normal approximation it stays
inside [0, 1] and is not empty at 0 or 100% (which small evaluations hit).

``agreement(a, b)`` compares two evaluations of the same problems, e.g. the
accuracies derived from one recorded pass and those served live (``Tally``s:
``EvalRun.tally``, or ``tallies(document)`` from a ``results.json``): for each
(method, N) in both, the difference of the accuracies against
``z * sqrt(2 p (1 - p) / K)`` (``p`` the pooled accuracy, ``K`` problems):
the spread of the difference of two independent binomial proportions. Runs
that share their seeds (``sart eval`` and ``sart eval --live`` sample branch
``j`` of a problem with the same seed) are positively correlated, so the
bound is conservative.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs

from sart import converters
from sart.bench.runner import RunRecord
from sart.metrics import Z95, wilson_interval
from sart.results import RequestResult


@attrs.frozen
class Tally:
    """How many problems one method at one ``N`` got right."""

    method: str
    n: int
    correct: int
    problems: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.problems if self.problems else math.nan


def tallies(document: dict) -> list[Tally]:
    """The tallies of a ``sart eval`` ``results.json`` document."""
    return [Tally(r["method"], r["n"], r["correct"], r["problems"]) for r in document["runs"]]


@attrs.frozen
class EvalRun:
    """One method at one ``N``: the served requests and each one's grade."""

    record: RunRecord
    correct: tuple[bool, ...] = attrs.field(converter=converters.bools)
    """Per request, in ``record.results``' order."""

    @classmethod
    def graded(cls, record: RunRecord, grade: Callable[[RequestResult], bool]) -> EvalRun:
        """``record`` with each completed request graded by ``grade`` (a failed one is wrong)."""
        return cls(record, [r.ok and grade(r) for r in record.results])

    @property
    def method(self) -> str:
        return self.record.method

    @property
    def n(self) -> int:
        return self.record.n

    @property
    def problems(self) -> int:
        return len(self.correct)

    @property
    def num_correct(self) -> int:
        return sum(self.correct)

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.problems if self.problems else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        """The 95% Wilson interval of ``accuracy``."""
        return wilson_interval(self.num_correct, self.problems)

    @property
    def tally(self) -> Tally:
        return Tally(self.method, self.n, self.num_correct, self.problems)

    @property
    def tokens_per_request(self) -> float:
        return self.record.summary.tokens_per_request

    def by_field(self, values: dict[str, object]) -> dict[object, tuple[int, int]]:
        """``{value: (correct, problems)}`` grouping the problems by ``values[id]``
        (e.g. MATH's ``level``); problems without a value are left out."""
        out: dict[object, tuple[int, int]] = {}
        for result, correct in zip(self.record.results, self.correct):
            value = values.get(result.request_id)
            if value is None:
                continue
            right, total = out.get(value, (0, 0))
            out[value] = (right + correct, total + 1)
        try:
            return dict(sorted(out.items()))
        except TypeError:  # values of mixed types: in the order of their text
            return dict(sorted(out.items(), key=lambda kv: str(kv[0])))


@attrs.frozen
class Agreement:
    """One (method, N) evaluated twice."""

    method: str
    n: int
    problems: int
    first: float
    """Accuracy of the first evaluation (e.g. derived)."""
    second: float
    """Accuracy of the second (e.g. live)."""
    tolerance: float
    """``z * sqrt(2 p (1 - p) / K)`` for the pooled accuracy ``p``, at least ``1 / K``."""

    @property
    def difference(self) -> float:
        return self.second - self.first

    @property
    def ok(self) -> bool:
        return abs(self.difference) <= self.tolerance + 1e-12


def agreement(first: Sequence[Tally], second: Sequence[Tally], z: float = 3.0) -> list[Agreement]:
    """Each (method, N) evaluated in both, compared (see the module docstring); ``z = 3``
    flags a difference a chance one time in 370 per comparison."""
    others = {(t.method, t.n): t for t in second}
    out = []
    for run in first:
        other = others.get((run.method, run.n))
        if other is None:
            continue
        k = min(run.problems, other.problems)
        pooled = (run.correct + other.correct) / (run.problems + other.problems)
        spread = z * math.sqrt(2 * pooled * (1 - pooled) / k) if k else math.inf
        out.append(
            Agreement(
                run.method,
                run.n,
                k,
                run.accuracy,
                other.accuracy,
                max(spread, 1 / k if k else math.inf),
            )
        )
    return out


__all__ = ["Z95", "Agreement", "EvalRun", "Tally", "agreement", "tallies", "wilson_interval"]
