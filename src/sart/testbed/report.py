"""Calibration of the testbed: does it show the phenomena SART is about? ``sart testbed report``.

Samples ``n`` branches per question at temperature 1 from the policy (the
seeded sampler of ``sart.testbed.model``), grades them exactly, scores them
with the PRM through ``sart.prm.hf.QwenMathPRM`` (the adapter sart uses) at
50% and at 100% of each branch's tokens, and measures:

- length spread within a question: coefficient of variation of the branch
  lengths (median over questions) and longest / shortest;
- length vs correctness within a question: Pearson r per question (mean over
  questions where both vary) and pooled over per-question deviations;
- branch accuracy, overall and by difficulty; majority vote of the ``n``;
- the PRM: AUROC of the branch reward for final correctness at 50% and at
  100% of the trace (per aggregation), and best-of-``n`` by reward.

The statistics are pure functions (``auroc``, ``pearson``... in
``sart.rollouts``), tested on their own; drawing and scoring the branches is
``sart.testbed.draw``. Needs the ``[hf]`` extra to sample.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from sart import converters
from sart.errors import config_check
from sart.prm.aggregate import AGGREGATIONS, aggregate
from sart.rollouts import REAL_RANGES, Rollout, auroc, majority, nan_mean, pearson, rollout_shape
from sart.testbed.draw import Branch, draw, score_drawn
from sart.testbed.specs import TESTBEDS


def _aggregated(branch: Branch, how: str) -> float:
    return aggregate(branch.full_rewards, how)


#: What the long testbed is built to show (issue "a long, hard testbed"): field ->
#: (low, high). ``Calibration.misfits`` checks these and the relations between them.
LONG_RANGES: dict[str, tuple[float, float]] = {
    "median_length": (400, 1000),
    "longest": (2000, math.inf),
    # The shape of real reasoning, as sart's workloads are held to it.
    "median_length_cv": REAL_RANGES["median_cv"],
    "median_longest_over_shortest": REAL_RANGES["median_spread"],
    "median_within_question_r": REAL_RANGES["median_r"],
    "capped_share": (0.002, 0.2),
    "branch_accuracy": (0.45, 0.65),
    "majority_accuracy": (0.0, 0.85),
}

#: The short testbed's targets, as printed (it was built before the ranges above).
SHORT_TARGETS = {
    "median_length_cv": "0.2-0.5",
    "median_longest_over_shortest": "~2-4x",
    "mean_within_question_r": "|r| <= 0.3",
    "branch_accuracy": "0.4-0.8",
    "auroc_half": ">= 0.75",
    "auroc_full": "well below 1",
}


@attrs.frozen
class Calibration:
    """The report's numbers (see the module docstring)."""

    n: int
    questions: int
    seed: int
    median_length_cv: float
    median_longest_over_shortest: float
    mean_length: float
    mean_within_question_r: float
    pooled_within_question_r: float
    branch_accuracy: float
    accuracy_by_difficulty: dict[int, float]
    majority_accuracy: float
    oracle_accuracy: float
    """Share of questions with at least one correct branch."""
    finished_share: float
    auroc_half: dict[str, float]
    """Per aggregation: AUROC for final correctness from the first 50% of tokens."""
    auroc_full: dict[str, float]
    best_of_n_accuracy: dict[str, float]
    """Per aggregation: accuracy of the branch with the highest final reward."""
    aggregation: str
    """The aggregation the testbed PRM is meant for (``sart.testbed.PRM_AGGREGATION``)."""
    median_length: float = math.nan
    longest: int = 0
    median_within_question_r: float = math.nan
    """Median over questions where both vary (``sart.rollouts.rollout_shape``)."""
    correct_over_wrong: float = math.nan
    """Mean length of correct over wrong branches, each relative to its question's mean."""
    capped_share: float = math.nan
    """Branches cut at the token cap with no answer (loops)."""
    testbed: str = "testbed"

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        """The inverse of ``to_json`` after a JSON round trip (difficulties as keys
        come back as strings)."""
        by_difficulty = {int(k): v for k, v in data["accuracy_by_difficulty"].items()}
        return cls(**{**data, "accuracy_by_difficulty": by_difficulty})

    def misfits(self) -> list[str]:
        """For the long testbed: the numbers outside ``LONG_RANGES`` or breaking its
        relations (majority >= branch accuracy + 0.1, accuracy falling with
        difficulty, PRM AUROC at 50% >= 0.7, best of n by PRM above the majority);
        empty when all hold. The short testbed has targets, not ranges: empty."""
        if self.testbed != "testbed-long":
            return []
        out = [
            f"{name}={getattr(self, name):.3f} (range {low:g} .. {high:g})"
            for name, (low, high) in LONG_RANGES.items()
            if not low <= getattr(self, name) <= high
        ]
        agg = self.aggregation
        by_difficulty = [v for _, v in sorted(self.accuracy_by_difficulty.items())]
        relations = [
            (self.majority_accuracy >= self.branch_accuracy + 0.1, "majority >= branch + 0.1"),
            (by_difficulty[0] > by_difficulty[-1], "accuracy falls with difficulty"),
            (self.auroc_half[agg] >= 0.7, f"PRM AUROC at 50% ({agg}) >= 0.7"),
            (
                self.best_of_n_accuracy[agg] > self.majority_accuracy,
                f"best of {self.n} by PRM ({agg}) > majority",
            ),
        ]
        return out + [f"not: {what}" for ok, what in relations if not ok]

    def text(self) -> str:
        agg = self.aggregation
        long = self.testbed == "testbed-long"

        def target(name: str) -> str:
            if long and name in LONG_RANGES:
                low, high = LONG_RANGES[name]
                return f"  (range {low:g} .. {high:g})" if high != math.inf else f"  (>= {low:g})"
            return f"  (target {SHORT_TARGETS[name]})" if not long and name in SHORT_TARGETS else ""

        rows = [
            ("questions x branches", f"{self.questions} x {self.n} (seed {self.seed})"),
            ("median length (tokens)", f"{self.median_length:.1f}{target('median_length')}"),
            ("longest (tokens)", f"{self.longest}{target('longest')}"),
            ("mean length (tokens)", f"{self.mean_length:.1f}"),
            ("median length CV", f"{self.median_length_cv:.3f}{target('median_length_cv')}"),
            (
                "median longest/shortest",
                f"{self.median_longest_over_shortest:.2f}x{target('median_longest_over_shortest')}",
            ),
            (
                "length-correct r (median)",
                f"{self.median_within_question_r:+.3f}{target('median_within_question_r')}",
            ),
            (
                "length-correct r (mean)",
                f"{self.mean_within_question_r:+.3f}{target('mean_within_question_r')}",
            ),
            ("length-correct r (pooled)", f"{self.pooled_within_question_r:+.3f}"),
            ("correct / wrong length", f"{self.correct_over_wrong:.3f}"),
            ("cut at the cap (loops)", f"{self.capped_share:.3f}{target('capped_share')}"),
            ("branch accuracy", f"{self.branch_accuracy:.3f}{target('branch_accuracy')}"),
            *(
                (f"  difficulty {k}", f"{v:.3f}")
                for k, v in sorted(self.accuracy_by_difficulty.items())
            ),
            (f"majority of {self.n}", f"{self.majority_accuracy:.3f}{target('majority_accuracy')}"),
            (f"best of {self.n} by PRM ({agg})", f"{self.best_of_n_accuracy[agg]:.3f}"),
            (f"any of {self.n} correct", f"{self.oracle_accuracy:.3f}"),
            ("finished (EOS) share", f"{self.finished_share:.3f}"),
            (f"PRM AUROC at 50% ({agg})", f"{self.auroc_half[agg]:.3f}{target('auroc_half')}"),
            (f"PRM AUROC at 100% ({agg})", f"{self.auroc_full[agg]:.3f}{target('auroc_full')}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append("")
        lines.append(f"{'aggregation':<12} {'AUROC 50%':>10} {'AUROC 100%':>11} {'best-of-n':>10}")
        for how in self.auroc_half:
            lines.append(
                f"{how:<12} {self.auroc_half[how]:>10.3f} {self.auroc_full[how]:>11.3f} "
                f"{self.best_of_n_accuracy[how]:>10.3f}"
            )
        if long:
            misfits = self.misfits()
            lines.append("")
            lines.append(
                "outside the long testbed's ranges: " + "; ".join(misfits)
                if misfits
                else "every number in the long testbed's ranges"
            )
        return "\n".join(lines)


def summarize(
    branches: Sequence[Branch], n: int, seed: int, aggregation: str, testbed: str = "testbed"
) -> Calibration:
    """The calibration numbers of graded, scored branches (``n`` per question)."""
    by_question: dict[int, list[Branch]] = {}
    for b in branches:
        by_question.setdefault(b.question, []).append(b)
    rs, dev_len, dev_ok = [], [], []
    majority_ok, oracle_ok = [], []
    best: dict[str, list[bool]] = {how: [] for how in AGGREGATIONS}
    for group in by_question.values():
        lengths = [max(1, b.length) for b in group]
        correct = [float(b.correct) for b in group]
        rs.append(pearson(lengths, correct))
        ml, mc = statistics.fmean(lengths), statistics.fmean(correct)
        dev_len += [x - ml for x in lengths]
        dev_ok += [y - mc for y in correct]
        vote = majority([b.answer for b in group])
        majority_ok.append(any(b.correct for b in group if b.answer == vote))
        oracle_ok.append(any(b.correct for b in group))
        for how in AGGREGATIONS:
            chosen = max(group, key=functools.partial(_aggregated, how=how))
            best[how].append(chosen.correct)
    by_difficulty: dict[int, list[bool]] = {}
    for b in branches:
        by_difficulty.setdefault(b.difficulty, []).append(b.correct)
    labels = [b.correct for b in branches]
    shape = rollout_shape(
        [
            [Rollout(b.length, b.correct, b.answer, capped=not b.finished) for b in group]
            for group in by_question.values()
        ]
    )
    return Calibration(
        n=n,
        questions=len(by_question),
        seed=seed,
        median_length_cv=shape.median_cv,
        median_longest_over_shortest=shape.median_spread,
        mean_length=statistics.fmean(b.length for b in branches),
        mean_within_question_r=nan_mean(rs),
        pooled_within_question_r=pearson(dev_len, dev_ok),
        branch_accuracy=statistics.fmean(labels),
        accuracy_by_difficulty={k: statistics.fmean(v) for k, v in sorted(by_difficulty.items())},
        majority_accuracy=statistics.fmean(majority_ok),
        oracle_accuracy=statistics.fmean(oracle_ok),
        finished_share=statistics.fmean(b.finished for b in branches),
        auroc_half={
            how: auroc([aggregate(b.half_rewards, how) for b in branches], labels)
            for how in AGGREGATIONS
        },
        auroc_full={
            how: auroc([aggregate(b.full_rewards, how) for b in branches], labels)
            for how in AGGREGATIONS
        },
        best_of_n_accuracy={how: statistics.fmean(v) for how, v in best.items()},
        aggregation=aggregation,
        median_length=shape.median_length,
        longest=shape.longest,
        median_within_question_r=shape.median_r,
        correct_over_wrong=shape.correct_over_wrong,
        capped_share=shape.capped_share,
        testbed=testbed,
    )


# --------------------------------------------------------------------------- the run


@attrs.frozen
class ReportConfig:
    """What the report samples."""

    n: int = 8
    questions: int = 120
    seed: int = 0
    difficulties: tuple[int, ...] = attrs.field(
        default=(3, 4, 5, 6, 7, 8), converter=converters.ints
    )
    max_new_tokens: int = 256

    testbed: str = "testbed"
    """Which shipped testbed (``sart.testbed.specs``): its weights by default.
    ``ReportConfig.of(name)`` also takes its difficulties and token cap."""
    compact: bool = False
    """Sample with finished rows dropped from the batch (``sample(compact=True)``):
    the long testbed's report does, its loops would hold whole batches otherwise."""

    def __attrs_post_init__(self) -> None:
        config_check(self.n >= 2, "n", self.n, ">= 2 (length spread needs two branches)")
        config_check(self.questions >= 1, "questions", self.questions, ">= 1")
        config_check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1")
        config_check(self.testbed in TESTBEDS, "testbed", self.testbed, f"one of {list(TESTBEDS)}")

    @classmethod
    def of(cls, testbed: str = "testbed", **fields: Any) -> ReportConfig:
        """The report of ``testbed``: its difficulties and token cap (``fields`` override)."""
        bed = TESTBEDS[testbed] if testbed in TESTBEDS else None
        defaults: dict[str, Any] = (
            {"difficulties": bed.difficulties, "max_new_tokens": bed.max_tokens} if bed else {}
        )
        if testbed == "testbed-long":
            defaults["compact"] = True
        return cls(testbed=testbed, **{**defaults, **fields})


def sample_branches(
    config: ReportConfig,
    policy_dir: str | Path | None = None,
    prm_dir: str | Path | None = None,
    threads: int = 1,
) -> list[Branch]:
    """Sample, grade and score ``config.n`` branches for each of ``config.questions``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sart.prm.hf import QwenMathPRM
    from sart.testbed.tasks import make_questions

    bed = TESTBEDS[config.testbed]
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir or bed.policy_path)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir or bed.policy_path).eval()
    prm = QwenMathPRM.from_pretrained(
        prm_dir or bed.prm_path, incremental=False, batch_size=64, **bed.prm_kwargs()
    )
    questions = make_questions(config.seed, config.questions, config.difficulties, bed.cycle)
    drawn = draw(
        questions,
        config.n,
        policy,
        tokenizer,
        config.seed,
        config.max_new_tokens,
        compact=config.compact,
    )
    return score_drawn(prm, drawn, config.n)


def calibrate(
    config: ReportConfig | None = None,
    policy_dir: str | Path | None = None,
    prm_dir: str | Path | None = None,
    threads: int = 1,
) -> Calibration:
    """Sample and summarise: the calibration report of the given (default: shipped) weights."""
    from sart.testbed import PRM_AGGREGATION

    config = config or ReportConfig()
    branches = sample_branches(config, policy_dir, prm_dir, threads)
    return summarize(branches, config.n, config.seed, PRM_AGGREGATION, config.testbed)
