"""PRM time per SART check vs the number of branches: one by one vs batched.

A SART check re-scores every running branch of a request after each has
generated ``T`` more tokens. With ``incremental=True`` each branch continues
from its own cached prefix; ``TransformersPRM`` feeds the new tokens of all
the check's branches in padded forwards of ``batch_size`` rows, each row on
its own cache (``batch_size=1`` is the one-by-one path). This times steady
state checks on the shipped testbed PRM (``sart.testbed``, a 4-layer Llama
with running features on its cache, see ``modeling_testbed_prm``): ``B``
branches of one question, already cached up to ``--warm`` response tokens,
each check adding ``--new`` tokens to every branch. The responses are the
testbed's noisy traces (joined when one is too short), cut at word
boundaries, so the rewards are the real model's on plausible text.

Reported per ``B``: milliseconds per check (median over ``--repeats`` runs
of ``--checks`` checks each), PRM forwards per check, and the ratio to a
check of one branch with the same mode.

    OMP_NUM_THREADS=1 python benchmarks/prm_batching.py             # B = 1, 8, 32
    OMP_NUM_THREADS=1 python benchmarks/prm_batching.py --branches 32 --profile

Target (the PRM batching issue): a check of 32 branches x 16 new tokens
costs at most 3x a check of one branch (batched).

Measured (1 thread of a shared 2-core CPU, noisy to about 15%): 32
branches cost about 36 ms a check batched against 90 to 110 ms one by one
(1 forward instead of 32), but 12 to 14x a one-branch check (about 3 ms),
not 3x. The forward itself is the floor: 32 rows of 17 tokens on about 220
cached positions take about 23 ms (the matrix products of 544 tokens are
already 3 one-branch checks), against 3 ms for the whole one-branch check,
whose cost is mostly per-forward overhead. The rest is merging the rows'
caches into one and splitting it back (about 6 ms each: a copy of every
cached key and value), tokenisation and Python (about 2 ms). ``--profile``
shows where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch

from sart.prm.base import ScoreItem
from sart.prm.hf import QwenMathPRM
from sart.testbed import PRM_PATH, make_question, noisy_trace, prm_kwargs
from sart.types import BranchId

MODES = {"one-by-one": 1, "batched": None}
"""``batch_size`` per mode; ``None``: as many rows as branches."""


def responses(count: int, words: int, seed: int) -> tuple[str, list[list[str]]]:
    """A question and ``count`` responses of at least ``words`` words each."""
    rng = random.Random(seed)
    question = make_question(rng, 8)
    out = []
    for _ in range(count):
        text: list[str] = []
        while len(text) < words:
            text += [*noisy_trace(question, rng).split(" "), "\n\n"]
        out.append(text)
    return question.prompt, out


def run(
    prm: QwenMathPRM, prompt: str, texts: list[list[str]], warm: int, new: int, checks: int
) -> tuple[float, float]:
    """Seconds and forwards per check, after a warm-up check that fills the caches."""

    def check(n: int) -> None:
        prm.score(
            [
                ScoreItem(BranchId("bench", j), prompt, " ".join(words[:n]), n, False)
                for j, words in enumerate(texts)
            ]
        )

    check(warm)
    calls = prm.forward_calls
    start = time.perf_counter()
    for k in range(1, checks + 1):
        check(warm + k * new)
    return (time.perf_counter() - start) / checks, (prm.forward_calls - calls) / checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new", type=int, default=16, help="new tokens per branch per check")
    parser.add_argument("--warm", type=int, default=96, help="response tokens cached at first")
    parser.add_argument("--checks", type=int, default=8, help="timed checks per run")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--profile", action="store_true", help="cProfile the largest batched B")
    args = parser.parse_args()
    torch.set_num_threads(1)

    base = QwenMathPRM.from_pretrained(PRM_PATH, **prm_kwargs())
    kwargs = prm_kwargs()

    def make(batch_size: int) -> QwenMathPRM:
        return QwenMathPRM(base.model, base.tokenizer, batch_size=batch_size, **kwargs)

    words = args.warm + args.checks * args.new
    prompt, texts = responses(max(args.branches), words, seed=0)
    print(
        f"testbed PRM, torch threads {torch.get_num_threads()}; responses {args.warm} -> "
        f"{words} tokens (+{args.new} per check), question {len(prompt.split())} tokens"
    )
    print(f"{'mode':>10} {'B':>4} {'ms/check':>9} {'ms/branch':>10} {'fwd/check':>10} {'x B=1':>6}")
    medians: dict[tuple[str, int], float] = {}
    for mode in args.modes:
        for b in args.branches:
            size = MODES[mode] or b
            runs = [
                run(make(size), prompt, texts[:b], args.warm, args.new, args.checks)
                for _ in range(args.repeats)
            ]
            seconds = medians[mode, b] = statistics.median(s for s, _ in runs)
            single = medians.get((mode, 1))
            ratio = f"{seconds / single:>6.2f}" if single else f"{'':>6}"
            print(
                f"{mode:>10} {b:>4} {1e3 * seconds:>9.2f} {1e3 * seconds / b:>10.3f} "
                f"{runs[0][1]:>10.1f} {ratio}"
            )
    if {("batched", 1), ("batched", 32)} <= medians.keys():
        ratio = medians["batched", 32] / medians["batched", 1]
        print(f"target: a check of 32 branches <= 3x one branch; measured {ratio:.1f}x")
    if args.profile:
        b = max(args.branches)
        profiler = cProfile.Profile()
        profiler.enable()
        run(make(b), prompt, texts[:b], args.warm, args.new, args.checks)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
