"""How math-verify grades MATH-500's own gold answers: against themselves, against
rewrites of themselves, and against every other problem's answer.

    python benchmarks/math500_agreement.py                      # ../shared/data, 8 processes
    python benchmarks/math500_agreement.py --data math500.jsonl --processes 16
    python benchmarks/math500_agreement.py --quick              # first 20 answers, 2 processes

Needs ``sart[eval]``. Prints:

- self-verification: how many of the 500 gold answers ``MathVerifyGrader``
  verifies against themselves (response ``\\boxed{answer}``);
- rewrites: for each rewrite (those of ``tests/test_eval_grading.py``) (in a
  sentence, ``\\dfrac``/``\\frac``, spaces, no ``\\left``/``\\right``, inline
  math), how many of the 500 fail;
- cross pairs: every ordered pair of *different* answer strings (gold first)
  that verifies: the same answer written two ways, or a convention of
  math-verify's. About 90 000 comparisons: minutes, spread over processes.

``--quick`` (a few seconds; what the tests run so that the script keeps
working) does all of that on the first 20 problems only, on 2 processes
unless ``--processes`` says otherwise: a smoke run, not the measurement.
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
from collections.abc import Iterator
from multiprocessing import Pool
from pathlib import Path

from sart.eval import MathVerifyGrader, load_dataset
from sart.eval.mathverify import boxed, verify_texts

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500" / "test.jsonl"

ANSWERS: list[str] = []
QUICK_PROBLEMS = 20


def rewrites(answer: str) -> Iterator[tuple[str, str]]:
    """``(name, response)``: the rewrites of ``tests/test_eval_grading.py``."""
    yield "sentence", f"So the final answer is $\\boxed{{{answer}}}$."
    yield "boxed", f"\\boxed{{{answer}}}"
    yield "dfrac", boxed(re.sub(r"\\[dt]?frac", r"\\dfrac", answer))
    yield "frac", boxed(re.sub(r"\\[dt]frac", r"\\frac", answer))
    yield "spaces", f"\\boxed{{  {answer.replace(' ', '  ')} }}"
    yield "no left/right", boxed(re.sub(r"\\(?:left|right)(?![A-Za-z])", "", answer))
    yield "inline math", f"The answer is ${answer}$"


def _verified_against(i: int) -> list[tuple[str, str]]:
    gold = ANSWERS[i]
    return [
        (gold, other)
        for j, other in enumerate(ANSWERS)
        if j != i and verify_texts(boxed(gold), boxed(other), 5)
    ]


def _init(answers: list[str]) -> None:
    ANSWERS[:] = answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--processes", type=int, help="default 8 (2 with --quick)")
    parser.add_argument(
        "--quick", action="store_true", help=f"first {QUICK_PROBLEMS} problems only: a smoke run"
    )
    args = parser.parse_args()
    if args.processes is None:
        args.processes = 2 if args.quick else 8
    golds = [p.answer for p in load_dataset("math500", args.data)]
    if args.quick:
        golds = golds[:QUICK_PROBLEMS]
    grader = MathVerifyGrader()

    failed = [(i, g) for i, g in enumerate(golds) if not grader.grade(boxed(g), g)]
    print(f"self-verification: {len(golds) - len(failed)}/{len(golds)}", failed or "")
    by_kind: dict[str, list[int]] = {}
    for i, gold in enumerate(golds):
        for kind, response in rewrites(gold):
            if not grader.grade(response, gold):
                by_kind.setdefault(kind, []).append(i)
    kinds = [kind for kind, _ in rewrites("x")]
    print("rewrites failing:", {kind: len(by_kind.get(kind, [])) for kind in kinds})

    distinct = sorted(set(golds))
    start = time.perf_counter()
    with Pool(args.processes, initializer=_init, initargs=(distinct,)) as pool:
        hits = list(
            itertools.chain.from_iterable(pool.map(_verified_against, range(len(distinct))))
        )
    seconds = time.perf_counter() - start
    comparisons = len(distinct) * (len(distinct) - 1)
    print(
        f"cross pairs: {len(hits)} of {comparisons} ordered pairs of different answers verify "
        f"({seconds:.0f} s on {args.processes} processes):"
    )
    for gold, other in hits:
        print(f"  gold {gold!r:<28} accepts {other!r}")


if __name__ == "__main__":
    main()
