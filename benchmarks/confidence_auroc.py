"""Where the policy's own confidence beats the PRM: AUROC for final correctness on the testbed.

sart can reward branches from the policy's log-probabilities
(``sart.rewards``, DeepConf-style) instead of serving a PRM. This
measures, on the testbed's calibration branches (``sart testbed report``'s:
120 questions of 3 to 8 digits, 8 branches each at temperature 1, seed 0),
how well each confidence signal separates right from wrong branches from the
first 50% of a trace's tokens and from all of them, side by side with the
shipped testbed PRM on the very same branches (aggregation
``sart.testbed.PRM_AGGREGATION``, as the report uses).

Per branch, the policy's raw log-probabilities of every generated token come
from one batched forward over prompt + generated tokens: the ``log_softmax``
of the logits at the position predicting each token, the sampled token's
value and the top ``k`` (``--top-k``, clamped to the vocabulary) — the numbers
sart's transformers engine reports with ``SamplingSettings(logprobs=k)``
(raw, before temperature; the testbed samples at temperature 1 anyway). They
are pushed, in order, into each signal's running state (``Signal.track()``),
read after ``len(tokens) // 2`` tokens and after all of them: exactly what an
online run would read at those points. The trace is the sampled tokens
without the EOS, the same text the PRM scores at 100%.

Columns: pooled AUROC over all branches at 50% / 100% (as the report's), the
mean within-question AUROC (questions with both right and wrong branches:
what pruning and selection among one question's branches rely on, with
question difficulty taken out), and best-of-``n`` accuracy by the value at
100%. Higher values mean more confident for every signal (confidences ``C``
and log-probabilities alike). A branch with no token in its first half has no
value there; it ranks lowest (counted in the JSON as ``empty_half``).
Windows default to the testbed's check interval (T = 16; traces are ~59
tokens); with ``--tail`` equal to ``--window`` (the default) ``tail`` and
``group`` are the same running state and give the same numbers. The JSON also
holds every branch's values (for bootstraps), the PRM per aggregation and
AUROCs per difficulty.

    OMP_NUM_THREADS=1 python benchmarks/confidence_auroc.py --out confidence-auroc.json

About 2 minutes on one thread of a busy 2-core machine (most of it sampling).

Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from sart.confidence.signals import (
    GroupConfidence,
    LowestGroupConfidence,
    LowestTokenLogprob,
    MeanTokenLogprob,
    Signal,
    TailConfidence,
    TokenConfidence,
)
from sart.messages import TokenLogprobs
from sart.prm.aggregate import AGGREGATIONS, aggregate
from sart.rollouts import auroc

#: The testbed's check interval T: a window of one check's tokens.
DEFAULT_WINDOW = 16
#: DeepConf's top-k width.
DEFAULT_TOP_K = 20


@attrs.frozen
class Config:
    """Everything that determines the numbers (written to the JSON as it is)."""

    questions: int = 120
    n: int = 8
    seed: int = 0
    difficulties: tuple[int, ...] = attrs.field(default=(3, 4, 5, 6, 7, 8), converter=tuple)
    max_new_tokens: int = 256
    top_k: int = DEFAULT_TOP_K
    window: int = DEFAULT_WINDOW
    tail: int = DEFAULT_WINDOW
    policy: str | None = None
    """Policy model directory (None: the shipped testbed policy)."""
    prm: str | None = None
    """PRM model directory (None: the shipped testbed PRM)."""
    threads: int = 1
    batch_size: int = 64
    """Branches per policy forward when computing log-probabilities."""


# --------------------------------------------------------------------------- pure parts


def make_signals(window: int, tail: int) -> dict[str, Signal]:
    """Every signal of ``sart.confidence.signals``, by its ``SIGNALS`` name."""
    return {
        "token": TokenConfidence(),
        "group": GroupConfidence(window),
        "lowest-group": LowestGroupConfidence(window),
        "tail": TailConfidence(tail),
        "lowest-logprob": LowestTokenLogprob(),
        "mean-logprob": MeanTokenLogprob(),
    }


def signal_values(
    logprobs: Sequence[TokenLogprobs], signals: Mapping[str, Signal]
) -> dict[str, tuple[float, float]]:
    """Each signal's value after the first ``len // 2`` tokens and after all of them
    (NaN where no token was pushed yet). One running state per signal, read
    half-way and at the end, as an online check would read it."""
    half = len(logprobs) // 2
    out: dict[str, tuple[float, float]] = {}
    for name, signal in signals.items():
        state = signal.track()
        for token in logprobs[:half]:
            state.push(token)
        at_half = state.value() if half else math.nan
        for token in logprobs[half:]:
            state.push(token)
        out[name] = (at_half, state.value() if logprobs else math.nan)
    return out


def _ranked(values: Sequence[float]) -> list[float]:
    # A branch with no value yet (an empty prefix) is the least confident of all.
    return [-math.inf if math.isnan(v) else v for v in values]


def within_question_auroc(
    scores: Sequence[float], labels: Sequence[bool], groups: Sequence[int]
) -> float:
    """Mean AUROC over the questions with both right and wrong branches (NaN if none)."""
    by_group: dict[int, tuple[list[float], list[bool]]] = {}
    for s, y, g in zip(_ranked(scores), labels, groups):
        by_group.setdefault(g, ([], []))
        by_group[g][0].append(s)
        by_group[g][1].append(y)
    values = [auroc(s, y) for s, y in by_group.values()]
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


def best_of_n(scores: Sequence[float], labels: Sequence[bool], groups: Sequence[int]) -> float:
    """Accuracy of each question's highest-scored branch (ties: the first)."""
    best: dict[int, tuple[float, bool]] = {}
    for s, y, g in zip(_ranked(scores), labels, groups):
        if g not in best or s > best[g][0]:
            best[g] = (s, y)
    return statistics.fmean(y for _, y in best.values())


@attrs.frozen
class Row:
    """One judge's numbers."""

    name: str
    auroc_half: float
    auroc_full: float
    within_half: float
    within_full: float
    best_of_n: float


def row(
    name: str,
    half: Sequence[float],
    full: Sequence[float],
    labels: Sequence[bool],
    groups: Sequence[int],
) -> Row:
    """A judge's row from its scores at 50% and 100% (higher = more likely right)."""
    return Row(
        name=name,
        auroc_half=auroc(_ranked(half), labels),
        auroc_full=auroc(_ranked(full), labels),
        within_half=within_question_auroc(half, labels, groups),
        within_full=within_question_auroc(full, labels, groups),
        best_of_n=best_of_n(full, labels, groups),
    )


def table(rows: Sequence[Row], n: int) -> str:
    """The rows as a plain-text table."""
    width = max(len("judge"), *(len(r.name) for r in rows))
    head = (
        f"{'judge':<{width}}  {'AUROC 50%':>9}  {'AUROC 100%':>10}  "
        f"{'within-q 50%':>12}  {'within-q 100%':>13}  {f'best-of-{n}':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.name:<{width}}  {r.auroc_half:>9.3f}  {r.auroc_full:>10.3f}  "
            f"{r.within_half:>12.3f}  {r.within_full:>13.3f}  {r.best_of_n:>9.3f}"
        )
    return "\n".join(lines)


def difficulty_table(by_difficulty: Mapping[int, Mapping[str, Any]], cut: str) -> str:
    """Pooled AUROC at ``cut`` ("50%" or "100%") per judge and question difficulty."""
    difficulties = sorted(by_difficulty)
    judges = [k for k in by_difficulty[difficulties[0]] if k != "accuracy"]
    width = max(len(f"AUROC {cut} by digits"), *(len(j) for j in judges))
    lines = [f"{f'AUROC {cut} by digits':<{width}}" + "".join(f"{d:>7}" for d in difficulties)]
    lines.append(
        f"{'(accuracy)':<{width}}"
        + "".join(f"{by_difficulty[d]['accuracy']:>7.3f}" for d in difficulties)
    )
    for judge in judges:
        lines.append(
            f"{judge:<{width}}"
            + "".join(f"{by_difficulty[d][judge][cut]:>7.3f}" for d in difficulties)
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- the model


def token_logprobs(
    policy: Any,
    prompts: Sequence[Sequence[int]],
    generated: Sequence[Sequence[int]],
    top_k: int,
    pad_id: int | None,
    batch_size: int = 64,
) -> list[list[TokenLogprobs]]:
    """The policy's raw log-probabilities of each generated token, per branch.

    One forward per ``batch_size`` branches over prompt + generated tokens,
    right-padded (with causal attention, padding after a row's tokens changes
    none of its positions or logits); row ``t`` of a branch is the
    ``log_softmax`` at position ``len(prompt) - 1 + t``, the distribution
    ``generated[t]`` was drawn from. ``top_k`` is clamped to the vocabulary, as
    the engines do.
    """
    import torch

    # Any id will do for padding (masked, and never read back); the testbed has one.
    pad = pad_id if pad_id is not None else 0
    out: list[list[TokenLogprobs]] = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            rows = [
                (list(p), list(g))
                for p, g in zip(
                    prompts[start : start + batch_size], generated[start : start + batch_size]
                )
            ]
            length = max(len(p) + len(g) for p, g in rows)
            ids = torch.full((len(rows), length), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), length), dtype=torch.long)
            for i, (p, g) in enumerate(rows):
                ids[i, : len(p) + len(g)] = torch.tensor(p + g, dtype=torch.long)
                mask[i, : len(p) + len(g)] = 1
            logits = policy(input_ids=ids, attention_mask=mask).logits
            logp = torch.log_softmax(logits.float(), dim=-1)
            k = min(top_k, logp.shape[-1])
            # Position j predicts token j + 1: the sampled token's value and the top k,
            # for every position at once, read back with one .tolist() per batch.
            following = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
            chosen = logp.gather(2, following[:, :, None]).squeeze(2).tolist()
            top = logp.topk(k, dim=-1).values.tolist() if k else None
            for i, (p, g) in enumerate(rows):
                first = len(p) - 1
                out.append(
                    [
                        TokenLogprobs(chosen[i][first + t], tuple(top[i][first + t]) if top else ())
                        for t in range(len(g))
                    ]
                )
    return out


def load(config: Config) -> tuple[Any, Any, Any]:
    """(policy, tokenizer, PRM) as the report loads them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sart.prm.hf import QwenMathPRM
    from sart.testbed import POLICY_PATH, PRM_PATH, prm_kwargs

    torch.set_num_threads(config.threads)
    policy_dir = config.policy or POLICY_PATH
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    prm = QwenMathPRM.from_pretrained(
        config.prm or PRM_PATH, incremental=False, batch_size=64, **prm_kwargs()
    )
    return policy, tokenizer, prm


def measure(config: Config) -> dict[str, Any]:
    """Sample, grade, score with the PRM and every confidence signal; the result's JSON."""
    from sart.testbed import PRM_AGGREGATION
    from sart.testbed.draw import draw, score_drawn
    from sart.testbed.tasks import make_questions

    started = time.perf_counter()
    policy, tokenizer, prm = load(config)
    loaded = time.perf_counter()
    questions = make_questions(config.seed, config.questions, config.difficulties)
    drawn = draw(questions, config.n, policy, tokenizer, config.seed, config.max_new_tokens)
    sampled = time.perf_counter()
    branches = score_drawn(prm, drawn, config.n)
    scored = time.perf_counter()
    # The same prompt ids ``draw`` sampled from.
    prompts = [tokenizer(d.question.prompt)["input_ids"] for d in drawn]
    logprobs = token_logprobs(
        policy,
        prompts,
        [d.sample.tokens for d in drawn],
        config.top_k,
        tokenizer.pad_token_id,
        config.batch_size,
    )
    signals = make_signals(config.window, config.tail)
    values = [signal_values(lps, signals) for lps in logprobs]
    done = time.perf_counter()

    labels = [b.correct for b in branches]
    groups = [b.question for b in branches]
    prm_name = f"PRM ({PRM_AGGREGATION})"
    # Every judge's (scores at 50%, scores at 100%), the PRM first.
    scores: dict[str, tuple[list[float], list[float]]] = {
        prm_name: (
            [aggregate(b.half_rewards, PRM_AGGREGATION) for b in branches],
            [aggregate(b.full_rewards, PRM_AGGREGATION) for b in branches],
        )
    }
    for name in signals:
        scores[name] = ([v[name][0] for v in values], [v[name][1] for v in values])
    rows = [row(name, half, full, labels, groups) for name, (half, full) in scores.items()]
    prm_by_aggregation = {
        how: attrs.asdict(
            row(
                how,
                [aggregate(b.half_rewards, how) for b in branches],
                [aggregate(b.full_rewards, how) for b in branches],
                labels,
                groups,
            )
        )
        for how in AGGREGATIONS
    }
    by_difficulty: dict[int, dict[str, Any]] = {}
    for difficulty in sorted({b.difficulty for b in branches}):
        keep = [i for i, b in enumerate(branches) if b.difficulty == difficulty]
        ys = [labels[i] for i in keep]
        entry: dict[str, Any] = {"accuracy": statistics.fmean(ys)}
        for name, (half, full) in scores.items():
            entry[name] = {
                "50%": auroc(_ranked([half[i] for i in keep]), ys),
                "100%": auroc(_ranked([full[i] for i in keep]), ys),
            }
        by_difficulty[difficulty] = entry
    import torch
    import transformers

    return {
        "config": attrs.asdict(config),
        "prm_aggregation": PRM_AGGREGATION,
        "signals": {name: repr(s) for name, s in signals.items()},
        "branches": len(branches),
        "branch_accuracy": statistics.fmean(labels),
        "mean_length": statistics.fmean(b.length for b in branches),
        "empty_half": sum(1 for b in branches if b.length // 2 == 0),
        "rows": [attrs.asdict(r) for r in rows],
        "prm_by_aggregation": prm_by_aggregation,
        "auroc_by_difficulty": by_difficulty,
        "per_branch": [
            {
                "question": b.question,
                "difficulty": b.difficulty,
                "length": b.length,
                "correct": b.correct,
                **{name: [half[i], full[i]] for name, (half, full) in scores.items()},
            }
            for i, b in enumerate(branches)
        ],
        "seconds": {
            "load": loaded - started,
            "sample": sampled - loaded,
            "prm": scored - sampled,
            "confidence": done - scored,
            "total": done - started,
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _json_safe(value: Any) -> Any:
    # JSON has no NaN or infinity: write null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, Path]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--questions", type=int, default=120)
    parser.add_argument("--n", type=int, default=8, help="branches per question")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulties", type=int, nargs="+", default=[3, 4, 5, 6, 7, 8])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    parser.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help="group window of 'group' and 'lowest-group' (default 16: the testbed's T)",
    )
    parser.add_argument("--tail", type=int, help="'tail' signal's tail length (default: --window)")
    parser.add_argument("--policy", help="policy model directory (default: shipped testbed)")
    parser.add_argument("--prm", help="PRM model directory (default: shipped testbed)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", default="confidence-auroc.json")
    args = parser.parse_args(argv)
    config = Config(
        questions=args.questions,
        n=args.n,
        seed=args.seed,
        difficulties=tuple(args.difficulties),
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        window=args.window,
        tail=args.tail if args.tail is not None else args.window,
        policy=args.policy,
        prm=args.prm,
        threads=args.threads,
        batch_size=args.batch_size,
    )
    return config, Path(args.out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    config, out = parse_args(argv)
    result = measure(config)
    rows = [Row(**r) for r in result["rows"]]
    print(
        f"{result['branches']} branches ({config.questions} questions x {config.n}, "
        f"seed {config.seed}), accuracy {result['branch_accuracy']:.3f}, "
        f"mean length {result['mean_length']:.1f} tokens; window {config.window}, "
        f"tail {config.tail}, top-k {config.top_k}"
    )
    print(table(rows, config.n))
    for cut in ("50%", "100%"):
        print()
        print(difficulty_table(result["auroc_by_difficulty"], cut))
    print(
        f"{result['seconds']['total']:.1f} s (load {result['seconds']['load']:.1f}, "
        f"sample {result['seconds']['sample']:.1f}, "
        f"PRM {result['seconds']['prm']:.1f}, confidence {result['seconds']['confidence']:.1f})"
    )
    out.write_text(json.dumps(_json_safe(result), indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
