"""What grading and voting by meaning cost: math-verify per call, on MATH-500's answers.

    python benchmarks/grading_cost.py                                  # ../shared/data
    python benchmarks/grading_cost.py --data path/to/math500.jsonl --problems 200

Needs ``sart[eval]`` (math-verify). Measures, on one core
(``OMP_NUM_THREADS=1``), for the first ``--problems`` gold answers:

- ``grade``: ``MathVerifyGrader.grade(response, gold)`` on a short response
  ending in ``\\boxed{...}`` (an equivalent rewrite of the gold answer), in
  the main thread: parse both, verify. Each response is new, so nothing is
  cached but math-verify's own LaTeX cache;
- ``same``: ``MathVerifyEquivalence.same(a, b)`` on two spellings of one gold
  answer, on two different problems' answers (what a vote mostly asks:
  does this answer join that group? no), and on ``\frac{p}{q}`` against its
  decimal; *cold*: answers never seen before (two parses and a comparison, a
  vote's first look at an answer), *warm*: the same pairs again (parses
  cached: the comparison alone);
- ``grade from a thread``: the grade calls made from a worker thread, so
  they run in the worker process (one inter-process round trip each), after
  the worker's start, which is reported on its own;
- ``vote``: ``MajorityVote(equivalence=MathVerifyEquivalence())`` choosing
  among ``n`` answers written ``k`` ways each (fresh answers every vote).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import sart
from sart.eval import MathVerifyEquivalence, MathVerifyGrader
from sart.types import BranchStatus
from sart.views import BranchView

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500" / "test.jsonl"


def rewrite(answer: str, salt: int) -> str:
    """An equivalent spelling of ``answer`` that no cache has seen (``salt`` spaces)."""
    return answer.replace("\\frac", "\\dfrac") + " " * (1 + salt)


def per_call(calls: list[Callable[[], object]]) -> tuple[float, float, float]:
    """Median, mean and largest milliseconds per call."""
    times = []
    for call in calls:
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), statistics.fmean(times), max(times)


def in_thread(fn: Callable[[], object]) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--problems", type=int, default=100)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.data.read_text(encoding="utf-8").splitlines()]
    golds = [row["answer"] for row in rows[: args.problems]]
    grader, eq = MathVerifyGrader(), MathVerifyEquivalence()
    grader.grade("\\boxed{1}", "1")  # imports math-verify and sympy (not counted)

    def report(name: str, result: tuple[float, float, float]) -> None:
        median, mean, most = result
        print(f"{name:<36} median {median:7.3f} ms  mean {mean:7.3f} ms  max {most:8.1f} ms")

    report(
        "grade (main thread)",
        per_call(
            [
                (lambda g=g, i=i: grader.grade(f"So x = {i}.\n\n\\boxed{{{rewrite(g, i)}}}", g))
                for i, g in enumerate(golds)
            ]
        ),
    )
    fractions = [(p, q) for q in (2, 4, 5, 8, 16, 20, 25, 40) for p in range(1, 14) if p % q]
    kinds = {
        "same answer": [(rewrite(g, 100 + i), rewrite(g, 200 + i)) for i, g in enumerate(golds)],
        "different answers": [
            (rewrite(g, 300 + i), rewrite(golds[(i + 1) % len(golds)], 300 + i))
            for i, g in enumerate(golds)
            if g != golds[(i + 1) % len(golds)]
        ],
        "fraction vs decimal": [(f"\\frac{{{p}}}{{{q}}}", repr(p / q)) for p, q in fractions],
    }
    for kind, pairs in kinds.items():
        for heat in ("cold", "warm"):
            calls = [(lambda a=a, b=b: eq.same(a, b)) for a, b in pairs]
            report(f"same, {kind}, {heat}", per_call(calls))

    threaded = MathVerifyGrader()
    start = time.perf_counter()
    in_thread(lambda: threaded.grade("\\boxed{1}", "1"))
    print(f"{'worker start (spawn)':<36} {(time.perf_counter() - start) * 1e3:8.1f} ms once")
    results: list[tuple[float, float, float]] = []
    in_thread(
        lambda: results.append(
            per_call(
                [
                    (lambda g=g, i=i: threaded.grade(f"\\boxed{{{rewrite(g, 300 + i)}}}", g))
                    for i, g in enumerate(golds)
                ]
            )
        )
    )
    report("grade from a thread", results[0])
    threaded.close()

    for n, k in ((8, 2), (16, 4), (64, 4)):
        votes = []
        for v in range(10):
            answers = [rewrite(golds[(v * 7 + j % k) % len(golds)], 400 + v) for j in range(n)]
            views = [
                BranchView(j, BranchStatus.FINISHED, 10, None, "", end_step=j) for j in range(n)
            ]
            vote = sart.MajorityVote(equivalence=MathVerifyEquivalence())
            votes.append(
                lambda vote=vote, views=views, answers=answers: vote.choose(views, answers)
            )
        report(f"vote n={n}, {k} answers", per_call(votes))


if __name__ == "__main__":
    main()
