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
``sart.rollouts``), tested on their own. Needs the ``[hf]`` extra to sample.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from sart.errors import config_check
from sart.prm.aggregate import AGGREGATIONS, aggregate
from sart.rollouts import auroc, cv, majority, pearson

if TYPE_CHECKING:
    from sart.testbed.model import Sample
    from sart.testbed.tasks import Question

# --------------------------------------------------------------------------- statistics


def _nanmean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


# --------------------------------------------------------------------------- the data


@attrs.frozen
class Branch:
    """One sampled branch, graded and scored."""

    question: int
    difficulty: int
    length: int
    """Generated tokens, EOS excluded."""
    answer: str
    correct: bool
    finished: bool
    half_rewards: tuple[float, ...]
    """PRM step rewards of the first half of the tokens."""
    full_rewards: tuple[float, ...]


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

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def text(self) -> str:
        agg = self.aggregation
        rows = [
            ("questions x branches", f"{self.questions} x {self.n} (seed {self.seed})"),
            ("median length CV", f"{self.median_length_cv:.3f}   (target 0.2-0.5)"),
            ("median longest/shortest", f"{self.median_longest_over_shortest:.2f}x (target ~2-4x)"),
            ("mean length (tokens)", f"{self.mean_length:.1f}"),
            ("length-correct r (mean)", f"{self.mean_within_question_r:+.3f}  (target |r| <= 0.3)"),
            ("length-correct r (pooled)", f"{self.pooled_within_question_r:+.3f}"),
            ("branch accuracy", f"{self.branch_accuracy:.3f}   (target 0.4-0.8)"),
            *(
                (f"  difficulty {k}", f"{v:.3f}")
                for k, v in sorted(self.accuracy_by_difficulty.items())
            ),
            (f"majority of {self.n}", f"{self.majority_accuracy:.3f}"),
            (f"best of {self.n} by PRM ({agg})", f"{self.best_of_n_accuracy[agg]:.3f}"),
            (f"any of {self.n} correct", f"{self.oracle_accuracy:.3f}"),
            ("finished (EOS) share", f"{self.finished_share:.3f}"),
            (f"PRM AUROC at 50% ({agg})", f"{self.auroc_half[agg]:.3f}   (target >= 0.75)"),
            (f"PRM AUROC at 100% ({agg})", f"{self.auroc_full[agg]:.3f}   (target well below 1)"),
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
        return "\n".join(lines)


def summarize(branches: Sequence[Branch], n: int, seed: int, aggregation: str) -> Calibration:
    """The calibration numbers of graded, scored branches (``n`` per question)."""
    by_question: dict[int, list[Branch]] = {}
    for b in branches:
        by_question.setdefault(b.question, []).append(b)
    cvs, ratios, rs, dev_len, dev_ok = [], [], [], [], []
    majority_ok, oracle_ok = [], []
    best: dict[str, list[bool]] = {how: [] for how in AGGREGATIONS}
    for group in by_question.values():
        lengths = [max(1, b.length) for b in group]
        correct = [float(b.correct) for b in group]
        cvs.append(cv(lengths))
        ratios.append(max(lengths) / min(lengths))
        rs.append(pearson(lengths, correct))
        ml, mc = statistics.fmean(lengths), statistics.fmean(correct)
        dev_len += [x - ml for x in lengths]
        dev_ok += [y - mc for y in correct]
        vote = majority([b.answer for b in group])
        majority_ok.append(any(b.correct for b in group if b.answer == vote))
        oracle_ok.append(any(b.correct for b in group))
        for how in AGGREGATIONS:
            chosen = max(group, key=lambda b, how=how: aggregate(b.full_rewards, how))
            best[how].append(chosen.correct)
    by_difficulty: dict[int, list[bool]] = {}
    for b in branches:
        by_difficulty.setdefault(b.difficulty, []).append(b.correct)
    labels = [b.correct for b in branches]
    return Calibration(
        n=n,
        questions=len(by_question),
        seed=seed,
        median_length_cv=statistics.median(cvs),
        median_longest_over_shortest=statistics.median(ratios),
        mean_length=statistics.fmean(b.length for b in branches),
        mean_within_question_r=_nanmean(rs),
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
    )


# --------------------------------------------------------------------------- the run


@attrs.frozen
class ReportConfig:
    """What the report samples."""

    n: int = 8
    questions: int = 120
    seed: int = 0
    difficulties: tuple[int, ...] = attrs.field(default=(3, 4, 5, 6, 7, 8), converter=tuple)
    max_new_tokens: int = 256

    def __attrs_post_init__(self) -> None:
        config_check(self.n >= 2, "n", self.n, ">= 2 (length spread needs two branches)")
        config_check(self.questions >= 1, "questions", self.questions, ">= 1")
        config_check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1")


@attrs.frozen
class Drawn:
    """One sampled branch before grading: its text whole and cut to half its tokens."""

    question_index: int
    question: Question
    sample: Sample
    half: str
    """The decoded first ``len(tokens) // 2`` tokens: the trace at 50%."""
    text: str


def draw(
    questions: Sequence[Question],
    n: int,
    policy: Any,
    tokenizer: Any,
    seed: int,
    max_new_tokens: int = 256,
) -> list[Drawn]:
    """``n`` branches per question from the seeded sampler, in order."""
    import torch

    from sart.testbed.model import sample

    prompts = [tokenizer(q.prompt)["input_ids"] for q in questions for _ in range(n)]
    samples = sample(
        policy,
        prompts,
        eos_id=tokenizer.eos_token_id,
        generator=torch.Generator().manual_seed(seed),
        max_new_tokens=max_new_tokens,
    )
    out = []
    for index, s in enumerate(samples):
        qi = index // n
        tokens = list(s.tokens)
        half = tokenizer.decode(tokens[: len(tokens) // 2], skip_special_tokens=True)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        out.append(Drawn(qi, questions[qi], s, half, text))
    return out


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
    from sart.testbed import POLICY_PATH, PRM_PATH, prm_kwargs
    from sart.testbed.tasks import make_questions

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir or POLICY_PATH)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir or POLICY_PATH).eval()
    prm = QwenMathPRM.from_pretrained(
        prm_dir or PRM_PATH, incremental=False, batch_size=64, **prm_kwargs()
    )
    questions = make_questions(config.seed, config.questions, config.difficulties)
    drawn = draw(questions, config.n, policy, tokenizer, config.seed, config.max_new_tokens)
    return score_drawn(prm, drawn, config.n)


def score_drawn(prm: Any, drawn: Sequence[Drawn], n: int) -> list[Branch]:
    """Grade ``drawn`` (``n`` branches per question) and score each at 50% and
    100% of its tokens with ``prm`` (``step_rewards``)."""
    from sart.prm.base import ScoreItem
    from sart.testbed.tasks import grade
    from sart.types import BranchId

    items_half, items_full = [], []
    for index, d in enumerate(drawn):
        branch = BranchId(f"q{d.question_index}", index % n)
        length = len(d.sample.tokens)
        items_half.append(ScoreItem(branch, d.question.prompt, d.half, length // 2, False))
        items_full.append(ScoreItem(branch, d.question.prompt, d.text, length, True))
    half_rewards = prm.step_rewards(items_half)
    full_rewards = prm.step_rewards(items_full)
    return [
        Branch(
            question=d.question_index,
            difficulty=d.question.difficulty,
            length=len(d.sample.tokens),
            answer=_answer(d.text),
            correct=grade(d.question, d.text),
            finished=d.sample.finished,
            half_rewards=tuple(h),
            full_rewards=tuple(f),
        )
        for d, h, f in zip(drawn, half_rewards, full_rewards)
    ]


def _answer(text: str) -> str:
    from sart.answers import extract_answer

    return extract_answer(text)


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
    return summarize(branches, config.n, config.seed, PRM_AGGREGATION)
