"""The shape of a question's rollouts: length spread, over-thinking, loops, accuracy.

Real reasoning rollouts are not lognormal noise around one length: within a
question, wrong rollouts run longer than right ones (over-thinking, the
paper's Observation 1) and a few loop until the token cap. ``rollout_shape``
measures that on any set of graded rollouts grouped by question -- a
simulated workload, a recorded trace, a testbed's samples -- so the three can
be held to the same ranges (``REAL_RANGES``).

``REAL_RANGES`` are the ranges sart's workloads are fitted to. Their centre is
a public measurement of real rollouts (Qwen3-1.7B thinking on GPQA-Diamond,
48 questions x 10 rollouts): per-question length CV median 0.32, longest /
shortest median 2.9, within-question length-correctness Pearson r median
-0.19 (negative in 73% of questions), correct rollouts about 0.83x the length
of wrong ones, 7% at the 30k-token cap.

Pure: no I/O, no numpy.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half); NaN without both classes."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return math.nan
    ranked = sorted(scores)
    # Average rank of each distinct score (1-based), for ties.
    rank: dict[float, float] = {}
    i = 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j] == ranked[i]:
            j += 1
        rank[ranked[i]] = (i + 1 + j) / 2
        i = j
    rank_sum = math.fsum(rank[s] for s in pos)
    return (rank_sum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation; NaN when either side is constant."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = math.fsum((a - mx) ** 2 for a in x)
    syy = math.fsum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation (population standard deviation over mean)."""
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else math.nan


def majority(answers: Sequence[str]) -> str:
    """The most frequent answer; ties go to the one seen first."""
    counts = Counter(answers)
    return max(answers, key=lambda a: counts[a]) if answers else ""


def nan_median(values: Sequence[float]) -> float:
    """The median of the values that are not ``nan`` (``nan`` if none are)."""
    return _without_nan(statistics.median, values)


def nan_mean(values: Sequence[float]) -> float:
    """The mean of the values that are not ``nan`` (``nan`` if none are)."""
    return _without_nan(statistics.fmean, values)


def _without_nan(stat: Callable[[list[float]], float], values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return stat(kept) if kept else math.nan


@attrs.frozen
class Rollout:
    """One graded rollout of a question."""

    length: int
    """Generated tokens."""
    correct: bool
    answer: str = ""
    capped: bool = False
    """It reached the token cap (no answer of its own: a loop, or thinking cut short)."""


@attrs.frozen
class RolloutShape:
    """Per-question statistics of rollouts (medians over questions unless said)."""

    questions: int
    rollouts: int
    """Rollouts per question (the smallest group)."""
    median_length: float
    """Over all rollouts."""
    longest: int
    median_cv: float
    median_spread: float
    """Longest over shortest rollout of a question."""
    median_r: float
    """Pearson r of length and correctness, over questions where both vary."""
    negative_r_share: float
    """Share of those questions whose r is negative: wrong rollouts longer."""
    correct_over_wrong: float
    """Mean length of correct over mean length of wrong rollouts, pooled over
    questions that have both (each question's rollouts divided by its own mean
    length first, so long questions do not dominate)."""
    capped_share: float
    branch_accuracy: float
    majority_accuracy: float
    """Accuracy of the majority answer of the question's rollouts (capped ones do not vote)."""

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def rows(self) -> list[tuple[str, str, str]]:
        """(statistic, value, real range) rows for a table."""
        out = [
            ("questions x rollouts", f"{self.questions} x {self.rollouts}", ""),
            ("median length (tokens)", f"{self.median_length:,.0f}", ""),
            ("longest (tokens)", f"{self.longest:,}", ""),
        ]
        for name, (low, high) in REAL_RANGES.items():
            value = getattr(self, name)
            out.append((LABELS[name], f"{value:.3f}", f"{low:g} .. {high:g}"))
        out += [
            ("wrong longer (share of questions)", f"{self.negative_r_share:.3f}", ""),
            ("branch accuracy", f"{self.branch_accuracy:.3f}", ""),
            (f"majority of {self.rollouts}", f"{self.majority_accuracy:.3f}", ""),
        ]
        return out

    def misfits(self) -> list[str]:
        """The statistics outside ``REAL_RANGES``, with their values (empty: all in)."""
        out = []
        for name, (low, high) in REAL_RANGES.items():
            value = getattr(self, name)
            if not low <= value <= high:
                out.append(f"{name}={value:.3f} (real range {low:g} .. {high:g})")
        return out


#: The ranges a workload's rollouts must fall in to look like real reasoning
#: (see the module docstring for the measurement they are centred on).
REAL_RANGES: dict[str, tuple[float, float]] = {
    "median_cv": (0.25, 0.5),
    "median_spread": (2.0, 4.0),
    "median_r": (-0.35, -0.1),
    "correct_over_wrong": (0.7, 0.92),
    "capped_share": (0.005, 0.12),
}

LABELS = {
    "median_cv": "length CV",
    "median_spread": "longest / shortest",
    "median_r": "length-correct r",
    "correct_over_wrong": "correct / wrong length",
    "capped_share": "share at the token cap",
}


def rollout_shape(questions: Sequence[Sequence[Rollout]]) -> RolloutShape:
    """The shape of graded rollouts grouped by question (two or more each)."""
    groups = [list(g) for g in questions if len(g) >= 2]
    if not groups:
        raise ValueError("rollout_shape needs a question with two or more rollouts")
    cvs, spreads, rs = [], [], []
    right_len: list[float] = []
    wrong_len: list[float] = []
    majority_ok = []
    for group in groups:
        lengths = [max(1, r.length) for r in group]
        correct = [float(r.correct) for r in group]
        cvs.append(cv(lengths))
        spreads.append(max(lengths) / min(lengths))
        rs.append(pearson(lengths, correct))
        if 0 < sum(correct) < len(group):
            mean = statistics.fmean(lengths)
            right_len += [x / mean for x, ok in zip(lengths, correct) if ok]
            wrong_len += [x / mean for x, ok in zip(lengths, correct) if not ok]
        votes = [r.answer for r in group if not r.capped]
        vote = majority(votes)
        majority_ok.append(any(r.correct for r in group if r.answer == vote and votes))
    everything = [r for g in groups for r in g]
    varied = [r for r in rs if not math.isnan(r)]
    return RolloutShape(
        questions=len(groups),
        rollouts=min(len(g) for g in groups),
        median_length=statistics.median(r.length for r in everything),
        longest=max(r.length for r in everything),
        median_cv=nan_median(cvs),
        median_spread=nan_median(spreads),
        median_r=nan_median(rs),
        negative_r_share=sum(r < 0 for r in varied) / len(varied) if varied else math.nan,
        correct_over_wrong=(
            statistics.fmean(right_len) / statistics.fmean(wrong_len)
            if right_len and wrong_len
            else math.nan
        ),
        capped_share=statistics.fmean(r.capped for r in everything),
        branch_accuracy=statistics.fmean(r.correct for r in everything),
        majority_accuracy=statistics.fmean(majority_ok),
    )


def trace_rollouts(trace: Any, max_tokens: int | None = None) -> list[list[Rollout]]:
    """A ``sart.bench.traces.Trace``'s branches as graded rollouts, by request: a
    branch at its cap or longer, or without an answer (a recorded branch cut at its
    cap), is capped and wrong. The cap is ``max_tokens`` if given, else the one each
    request recorded (``TraceRequest.max_tokens``), else none."""
    out = []
    for request in trace:
        cap = max_tokens or getattr(request, "max_tokens", None) or 1 << 62
        group = []
        for b in request.branches:
            capped = b.length >= cap or not b.answer
            group.append(
                Rollout(
                    length=min(b.length, cap),
                    correct=not capped and b.answer == request.answer,
                    answer=b.answer,
                    capped=capped,
                )
            )
        out.append(group)
    return out
