"""Fit the simulator's fork model to forks served on a real engine.

A fork's child continues its parent's prefix with a seed of its own. Whether it
reaches the right answer depends on whether that prefix was still right where it
was forked, which the PRM's reward there says most about. This reads the forks of
real runs (a ``sart bench`` ``runs.jsonl``, plain or gzip-compressed, of
re-branching methods on ``--model testbed-long``), takes every child that
completed and whose parent had been scored by then, and fits
``P(child right) = sigmoid(intercept + slope * r)`` by logistic regression, ``r``
being the parent's last reward at or before the fork. It prints the fit (what
``sart.bench.traces.ForkModel`` holds), the log-likelihood of richer fits beside
it (with the share of the parent's tokens written, with whether the parent ended
right, where it did), and the observed rate by reward beside the fitted one:

    python benchmarks/fork_model.py benchmarks/runs/testbed-long-vllm-dev/runs.jsonl.gz \\
      --seed 1 --requests 60

``--seed`` and ``--requests`` are the runs' own (they say which questions, hence
which gold answers). ``--quick``: the bundled dev runs, as CI runs it.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from pathlib import Path

import numpy as np

from sart.bench.traces import ForkModel
from sart.testbed.specs import testbed

DEV_RUNS = Path(__file__).parent / "runs" / "testbed-long-vllm-dev" / "runs.jsonl.gz"
BUCKETS = (0.0, 0.5, 0.6, 0.7, 0.8, 1.01)


def samples(paths: list[Path], gold: dict[str, str]) -> np.ndarray:
    """``[reward at fork, share, parent right (-1: unknown), child right, step]`` per
    fork, ``step`` being the child's first reward after the fork less the parent's at
    it (NaN where the child was not scored after it)."""
    rows = []
    for path in paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                for result in json.loads(line)["run"]["results"]:
                    right = gold[result["request_id"]]
                    branches = result["branches"]
                    for b in branches:
                        if b.get("parent") is None or b["answer"] is None:
                            continue
                        parent = branches[b["parent"]]
                        seen = [r for t, r in parent["reward_history"] if t <= b["inherited"]]
                        if not seen or not parent["num_tokens"]:
                            continue
                        share = min(1.0, b["inherited"] / parent["num_tokens"])
                        ended = -1.0 if parent["answer"] is None else parent["answer"] == right
                        after = [r for t, r in b["reward_history"] if t > b["inherited"]]
                        step = after[0] - seen[-1] if after else float("nan")
                        rows.append((seen[-1], share, ended, b["answer"] == right, step))
    return np.array(rows, dtype=float).reshape(-1, 5)


def logistic(x: np.ndarray, y: np.ndarray, ridge: float = 1e-3) -> tuple[np.ndarray, float]:
    """Weights by Newton's method (a small ridge keeps them finite), and the fit's
    log-likelihood."""
    w = np.zeros(x.shape[1])
    for _ in range(100):
        p = 1 / (1 + np.exp(-x @ w))
        hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(len(w))
        step = np.linalg.solve(hess, x.T @ (p - y) + ridge * w)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    p = np.clip(1 / (1 + np.exp(-x @ w)), 1e-12, 1 - 1e-12)
    return w, float(np.sum(y * np.log(p) + (1 - y) * np.log(1 - p)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="runs.jsonl(.gz) files with forks")
    p.add_argument("--seed", type=int, default=1, help="the runs' --seed")
    p.add_argument("--requests", type=int, default=60, help="the runs' --requests")
    p.add_argument("--quick", action="store_true", help="the bundled dev runs (the default)")
    args = p.parse_args()
    paths = args.runs or [DEV_RUNS]
    bed = testbed("testbed-long")
    assert bed is not None
    gold = {f"t{i}": q.answer for i, q in enumerate(bed.questions(args.seed, args.requests))}
    data = samples(paths, gold)
    if not len(data):
        raise SystemExit("no forks with a scored parent in these runs")
    reward, share, ended, right, step = data.T
    one = np.ones_like(reward)
    (intercept, slope), ll = logistic(np.stack([one, reward], axis=1), right)
    _, ll_share = logistic(np.stack([one, reward, share], axis=1), right)
    known = ended >= 0
    _, ll_known = logistic(np.stack([one[known], reward[known]], axis=1), right[known])
    _, ll_ended = logistic(
        np.stack([one[known], reward[known], ended[known]], axis=1), right[known]
    )
    print(f"{len(data)} forks from {len(paths)} file(s)")
    print(
        f"fit: intercept {intercept:.3f}, slope {slope:.3f} (ForkModel: "
        f"{ForkModel().intercept:.3f}, {ForkModel().slope:.3f})"
    )
    print(
        f"log-likelihood: reward {ll:.1f}; reward + share {ll_share:.1f}; "
        f"where the parent ended ({int(known.sum())} forks): reward {ll_known:.1f}, "
        f"reward + parent right {ll_ended:.1f}"
    )
    # What the simulator's forks assume (sart.bench.traces.TraceScript): the PRM rates a
    # child's prefix as its parent's, so the child's reward moves on from the parent's.
    steps = step[~np.isnan(step)]
    if len(steps):
        low, mid, high = np.percentile(steps, [10, 50, 90])
        print(
            f"a child's first reward after its fork less its parent's there ({len(steps)} "
            f"forks): median {mid:+.3f}, 10th-90th percentile {low:+.3f} to {high:+.3f}"
        )
    print(f"{'reward':>11} {'forks':>6} {'right %':>8} {'fitted %':>9}")
    fitted = 1 / (1 + np.exp(-(intercept + slope * reward)))
    for low, high in itertools.pairwise(BUCKETS):
        mask = (reward >= low) & (reward < high)
        if mask.any():
            print(
                f"{low:4.2f}-{min(high, 1):4.2f} {int(mask.sum()):>6} "
                f"{100 * right[mask].mean():>8.1f} {100 * fitted[mask].mean():>9.1f}"
            )


if __name__ == "__main__":
    main()
