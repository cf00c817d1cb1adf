"""PRM tokens processed per generated token: full re-encoding vs the incremental cache.

SART re-scores every running branch each ``T`` generated tokens. Scoring the
whole response each time feeds the PRM about ``L / (2T)`` tokens per
generated token for a branch of ``L`` tokens; ``QwenMathPRM`` with
``incremental=True`` keeps each branch's KV cache and feeds only what changed.
This simulates one branch growing by ``T`` tokens per check up to ``L``
(synthetic reasoning steps of 15 to 150 tokens, separated by blank lines; the
last check is the final one) and reports ``tokens_processed / L`` for both,
on a tiny random PRM shaped like Qwen2.5-Math-PRM (the demo model, built here
with 16k positions so that 8k-token branches fit in its context).

The second table is the context limit: the real Qwen2.5-Math-PRM-7B has 4096
positions, so an 8k branch is windowed; with ``window_stride=1`` the window's
start moves at nearly every check and the cache must be rebuilt, with a
stride it moves in jumps and the cache is reused between them.
``--context-limit`` sets that limit (the model is built with at least that
many positions); a branch no longer than it is never windowed.

    python benchmarks/prm_cost.py                    # T = 100, 400; L = 1k, 2k, 4k, 8k
    python benchmarks/prm_cost.py --lengths 2000 --intervals 100
    python benchmarks/prm_cost.py --lengths 300 --intervals 100 --strides 1 32 \
        --context-limit 128                          # a few seconds: both tables, windowed

Target (the PRM issue): incremental <= 1.2 PRM tokens per generated token.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
from transformers import LlamaForTokenClassification

from sart.demo_models import _config, build_tokenizer
from sart.prm.base import ScoreItem
from sart.prm.hf import QwenMathPRM
from sart.types import BranchId

QUESTION = "What is the sum of the first 100 positive integers?"


def synthetic_response(tokenizer: Any, tokens: int, seed: int = 0) -> list[int]:
    """Token ids of a reasoning-like response of at least ``tokens`` tokens:
    steps of 15 to 150 tokens (demo-corpus arithmetic), blank lines between."""
    rng = random.Random(seed)
    steps: list[str] = []
    total = 0
    while total < tokens:
        size = rng.randint(15, 150)
        words: list[str] = [f"Step {len(steps) + 1}:"]
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < size:
            a, b = rng.randint(0, 39), rng.randint(0, 24)
            words.append(f"add {a} and {b}. {a} + {b} = {a + b}.")
        steps.append(" ".join(words))
        total = len(tokenizer.encode("\n\n".join(steps), add_special_tokens=False))
    return tokenizer.encode("\n\n".join(steps), add_special_tokens=False)


def simulate(prm: QwenMathPRM, tokenizer: Any, ids: list[int], interval: int, length: int) -> dict:
    """Score one branch every ``interval`` tokens up to ``length``; PRM cost per token."""
    branch = BranchId("bench", 0)
    checks = [*range(interval, length, interval), length]
    start = time.perf_counter()
    for n in checks:
        text = tokenizer.decode(ids[:n])
        prm.score([ScoreItem(branch, QUESTION, text, n, final=n == length)])
    return {
        "checks": len(checks),
        "ratio": prm.tokens_processed / length,
        "seconds": time.perf_counter() - start,
    }


def vllm_cpu_engine_args(context: int) -> dict[str, Any]:
    """vLLM engine arguments of the PRM benchmarks' runs on vLLM-CPU (``prm_window.py``,
    ``prm_cached.py``): float32, whole inputs of up to ``context`` tokens per step."""
    return dict(
        dtype="float32",
        block_size=32,  # vLLM-CPU needs a multiple of 32
        max_model_len=context,
        max_num_batched_tokens=context,
        enforce_eager=True,
        seed=0,
    )


def build_prm_model(tokenizer: Any, positions: int) -> Any:
    torch.manual_seed(0)
    config = _config(tokenizer, num_labels=2, max_position_embeddings=positions)
    return LlamaForTokenClassification(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    parser.add_argument("--intervals", type=int, nargs="+", default=[100, 400])
    parser.add_argument("--strides", type=int, nargs="+", default=[1, 1024, 2048])
    parser.add_argument(
        "--context-limit",
        type=int,
        default=4096,
        help="the second table's PRM context (default 4096, Qwen2.5-Math-PRM-7B's)",
    )
    args = parser.parse_args()
    torch.set_num_threads(min(8, torch.get_num_threads()))

    tokenizer = build_tokenizer()
    longest = max(args.lengths)
    # Enough positions for both tables: QwenMathPRM refuses a max_length beyond them.
    model = build_prm_model(tokenizer, positions=max(2 * longest, args.context_limit))
    ids = synthetic_response(tokenizer, longest)
    steps = tokenizer.decode(ids).count("\n\n") + 1
    print(f"synthetic response: {len(ids)} tokens, {steps} steps; PRM context {2 * longest}")
    print()
    print("PRM tokens processed / generated tokens (whole branch in context)")
    print(f"{'T':>5} {'L':>6} {'checks':>6} {'naive':>8} {'incremental':>12}", end=" ")
    print(f"{'naive s':>8} {'incr s':>7}")
    for interval in args.intervals:
        for length in args.lengths:
            runs = {
                mode: simulate(
                    QwenMathPRM(model, tokenizer, max_length=2 * longest, incremental=mode),
                    tokenizer,
                    ids,
                    interval,
                    length,
                )
                for mode in (False, True)
            }
            naive, incr = runs[False], runs[True]
            print(
                f"{interval:>5} {length:>6} {naive['checks']:>6} {naive['ratio']:>8.2f} "
                f"{incr['ratio']:>12.3f} {naive['seconds']:>8.1f} {incr['seconds']:>7.1f}"
            )

    print()
    limit = args.context_limit
    named = " (Qwen2.5-Math-PRM-7B)" if limit == 4096 else ""
    print(f"context limit {limit}{named}, incremental, L = {longest}")
    print(f"{'T':>5} {'stride':>7} {'PRM tokens / L':>15}")
    for interval in args.intervals:
        for stride in args.strides:
            prm = QwenMathPRM(model, tokenizer, max_length=limit, window_stride=stride)
            run = simulate(prm, tokenizer, ids, interval, longest)
            print(f"{interval:>5} {stride:>7} {run['ratio']:>15.3f}")


if __name__ == "__main__":
    main()
