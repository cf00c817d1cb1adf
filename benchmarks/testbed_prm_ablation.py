"""What a judge of half a testbed trace can know, and which PRM inputs get there.

Reproduces the measurements behind the testbed PRM's design (docs/testbed.md,
"Why the PRM reads the policy's likelihood"). Training data: the PRM's own
training examples (``sart.testbed.train_prm.prm_examples``: 4096 rollouts of the
shipped policy, half cut at a random token, outcome labels at every
separator). Evaluation: the calibration report's branches (120 questions x 8,
seed 0), each judged from its first 50% of tokens and from all of them.

Judges, each a logistic regression fitted on the training data (the shipped
PRM is fitted the same way on ``all features``):

- ``hidden state``: the frozen policy's last hidden state at the separator;
- ``likelihood``: the first five running features (lowest log-prob, sum,
  counts below 10% and 1%, response length);
- ``all features``: the shipped PRM's seven (adds question length, steps);
- ``shipped PRM``: the shipped weights, for reference.

And two oracles that read the grader, not the trace's likelihood:

- ``oracle: on track``: the grader's step label at the cut (is the value held
  the true running sum?), the best "still on track" judge;
- ``oracle: on track + ahead``: that label with the digits and carries still
  ahead (from the true sums), each combination's outcome rate on the
  training rollouts: about the best any judge of the prefix can do.

    python benchmarks/testbed_prm_ablation.py          # about 2 minutes on 1 thread
    python benchmarks/testbed_prm_ablation.py --quick  # seconds: a smoke run

``--quick`` shrinks every sample: 256 training rollouts instead of 4096, 8
evaluation questions x 8 instead of 120 x 8, and 256 oracle rollouts instead
of 4096. It runs every step (what the tests do, so that the script keeps
working), but its numbers mean little.

Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sart.prm.hf import QwenMathPRM
from sart.rollouts import auroc
from sart.testbed import PRM_PATH, prm_kwargs
from sart.testbed.draw import draw
from sart.testbed.logistic import fit_logistic
from sart.testbed.modeling_testbed_prm import FEATURES
from sart.testbed.report import ReportConfig
from sart.testbed.tasks import Question, grade, make_question, make_questions, step_labels
from sart.testbed.train import TrainConfig
from sart.testbed.train_common import pad_rows
from sart.testbed.train_prm import prm_examples

_POSITION = re.compile(r"p(\d+) \d \+")
QUICK_ROLLOUTS = 256
"""``--quick``'s training and oracle rollouts (4096 each otherwise)."""
QUICK_QUESTIONS = 8
"""``--quick``'s evaluation questions (8 branches each; 120 otherwise)."""


@torch.no_grad()
def inputs(prm: Any, rows: Sequence[list[int]], positions: Sequence[list[int]]) -> list[Any]:
    """(features, last hidden state) at each row's positions."""
    model = prm.model
    out = []
    for start in range(0, len(rows), 64):
        chunk = list(rows[start : start + 64])
        ids = pad_rows(chunk, prm.tokenizer.pad_token_id)
        mask = pad_rows([[1] * len(r) for r in chunk], 0)
        features = model.features(ids, mask)
        policy_ids = ids.masked_fill(ids == model.config.separator_id, model.config.step_word_id)
        hidden = model.policy(
            input_ids=policy_ids, attention_mask=mask, output_hidden_states=True
        ).hidden_states[-1]
        for k, where in enumerate(positions[start : start + 64]):
            out.append((features[k, where], hidden[k, where]))
    return out


def fit(x: torch.Tensor, y: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """The scoring function of a logistic regression fitted as the PRM's head is."""
    return fit_logistic(x, y, TrainConfig().prm_l2).logits


def oracle(question: Question, text: str) -> tuple[int, int, int]:
    """(on track, digits ahead, carries ahead) of a trace cut to ``text``."""
    labels = step_labels(question, text)
    reached = max((int(m) for m in _POSITION.findall(text)), default=0)
    reached = min(reached, question.difficulty)
    truth = question.running()
    carries = sum(
        1
        for i in range(reached, question.difficulty)
        if (truth[i - 1] if i >= 1 else 0) + question.digits[i] >= 10
    )
    return int(labels[-1] if labels else True), question.difficulty - reached, carries


def _item(index: int, question: Question, text: str) -> Any:
    from sart.prm.base import ScoreItem
    from sart.types import BranchId

    return ScoreItem(BranchId(f"b{index}", 0), question.prompt, text, len(text.split()), True)


def _best_of(scores: Sequence[float], labels: Sequence[bool], n: int) -> float:
    """Accuracy of the highest-scored branch of each group of ``n``."""
    picks = []
    for start in range(0, len(scores), n):
        best = max(range(start, start + n), key=lambda i: scores[i])
        picks.append(labels[best])
    return statistics.fmean(picks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small samples: a smoke run")
    args = parser.parse_args()
    oracle_rollouts = QUICK_ROLLOUTS if args.quick else 4096
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    prm = QwenMathPRM.from_pretrained(PRM_PATH, incremental=False, **prm_kwargs())
    tokenizer = prm.tokenizer
    policy = prm.model.policy

    # Training data: the PRM's own training examples (same seeds as train_prm).
    config = TrainConfig(prm_rollouts=QUICK_ROLLOUTS) if args.quick else TrainConfig()
    examples = prm_examples(config, policy, tokenizer, prm, log=lambda _line: None)
    train = inputs(prm, [e[0] for e in examples], [e[1] for e in examples])
    train_f = torch.cat([f for f, _ in train])
    train_h = torch.cat([h for _, h in train])
    train_y = torch.tensor([float(e[2]) for e in examples for _ in e[1]])

    # Evaluation: the report's branches, cut at 50% and whole.
    report = ReportConfig(questions=QUICK_QUESTIONS) if args.quick else ReportConfig()
    questions = make_questions(report.seed, report.questions, report.difficulties)
    drawn = draw(questions, report.n, policy, tokenizer, report.seed, report.max_new_tokens)
    branches = [(d.question, d.half, d.text, grade(d.question, d.text)) for d in drawn]
    labels = [b[3] for b in branches]

    # The oracle table: outcome rate per (on track, ahead, carries), from 4096
    # (--quick: 256) other rollouts of the policy (1 to 8 digits, as the PRM's training
    # rollouts) cut at 50% as the evaluation is.
    rng = random.Random(10)
    others = [make_question(rng, rng.randint(1, 8)) for _ in range(oracle_rollouts)]
    table: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for d in draw(others, 1, policy, tokenizer, seed=10):
        table[oracle(d.question, d.half)].append(float(grade(d.question, d.text)))

    judges = {
        "hidden state": (fit(train_h, train_y), "h"),
        "likelihood": (fit(train_f[:, :5], train_y), "l"),
        "all features": (fit(train_f, train_y), "f"),
    }
    results: dict[str, dict[str, float]] = {}
    for cut, index in (("50%", 1), ("100%", 2)):
        encoded = [prm.encode(b[0].prompt, b[index]) for b in branches]
        kept = [i for i, e in enumerate(encoded) if e.segments]
        evaluated = inputs(
            prm, [encoded[i].ids() for i in kept], [[encoded[i].positions()[-1]] for i in kept]
        )
        # The judges read the last separator, as the shipped PRM's ``last`` does.
        feats = torch.zeros(len(branches), len(FEATURES))
        hidden = torch.zeros(len(branches), train_h.shape[1])
        for i, (f, h) in zip(kept, evaluated):
            feats[i], hidden[i] = f[0], h[0]
        scores: dict[str, list[float]] = {}
        for name, (judge, kind) in judges.items():
            x = {"h": hidden, "l": feats[:, :5], "f": feats}[kind]
            scores[name] = judge(x).tolist()
        rewards = prm.score([_item(i, b[0], b[index]) for i, b in enumerate(branches)])
        scores["shipped PRM"] = list(rewards)
        on_track = [float(oracle(b[0], b[index])[0]) for b in branches]
        scores["oracle: on track"] = on_track
        scores["oracle: on track + ahead"] = [
            statistics.fmean(table.get(oracle(b[0], b[index]), [0.5])) for b in branches
        ]
        for name, s in scores.items():
            results.setdefault(name, {})[cut] = auroc(s, labels)
            if cut == "100%":
                results[name]["best-of-8"] = _best_of(s, labels, report.n)

    width = max(map(len, results))
    print(f"{'judge':<{width}}  AUROC 50%  AUROC 100%  best-of-{report.n}")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['50%']:>9.3f}  {r['100%']:>10.3f}  {r['best-of-8']:>9.3f}")
    print(f"branch accuracy {statistics.fmean(labels):.3f}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
