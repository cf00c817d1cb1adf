"""The transformers engine's decode rate on long branches: in-place decoding vs transformers' cache.

Starts ``--requests`` long-testbed questions with ``--n`` branches each
(temperature 1, up to ``--max-tokens``), decodes ``--steps`` steps, and reports
per mode the wall time per step, the tokens per second, and the model
forward's share. The two modes run side by side on one model, same seeds:
``in place`` (the engine's default: a step batch kept between steps, the new
token written into it, ``sart.engines.hf_kv``) and ``transformers cache``
(``HFEngine.in_place = False``: the batch rebuilt every step and handed to
transformers' ``DynamicCache``, which copies it, as for a model with
sliding-window layers). Both must give the same tokens; the script says so.

    OMP_NUM_THREADS=1 python benchmarks/hf_decode.py                 # 4 x 8 branches, 1,000 steps
    OMP_NUM_THREADS=1 python benchmarks/hf_decode.py --steps 20      # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import time

import torch

from sart.engines.hf import HFEngine
from sart.messages import BranchSpec
from sart.testbed import LONG, make_questions
from sart.types import SamplingSettings


def decode(engine: HFEngine, requests: int, n: int, steps: int, max_tokens: int) -> tuple:
    """Seconds, forward seconds, tokens and the tokens themselves of one run."""
    questions = make_questions(1, requests, LONG.difficulties, cycle=LONG.cycle)
    settings = SamplingSettings(temperature=1.0, max_tokens=max_tokens)
    for r, question in enumerate(questions):
        engine.prefill(f"r{r}", question.prompt, settings)
        engine.start_branches(f"r{r}", [BranchSpec(index=i, seed=i) for i in range(n)])
    tokens: dict[object, list[int]] = {}
    engine.forward_seconds = 0.0
    started = time.perf_counter()
    done = 0
    while done < steps and engine.stats().live_branches:
        out = engine.step(min(50, steps - done))
        done += out.steps
        for bid, delta in out.deltas.items():
            tokens.setdefault(bid, []).extend(delta.token_ids)
    seconds = time.perf_counter() - started
    for r in range(requests):
        engine.release_prefix(f"r{r}")
    return seconds, engine.forward_seconds, done, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=LONG.max_tokens)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = HFEngine.from_pretrained(str(LONG.policy_path))
    print(
        f"long testbed, {args.requests} requests x {args.n} branches, {args.steps} steps "
        f"(max_tokens {args.max_tokens}), torch threads {args.threads}"
    )
    print(f"{'mode':>20} {'steps':>6} {'ms/step':>8} {'tokens/s':>9} {'forward':>8}")
    runs = {}
    for mode, in_place in (("in place", True), ("transformers cache", False)):
        engine.in_place = in_place
        seconds, forward, steps, tokens = decode(
            engine, args.requests, args.n, args.steps, args.max_tokens
        )
        count = sum(len(t) for t in tokens.values())
        runs[mode] = (seconds, tokens)
        print(
            f"{mode:>20} {steps:>6} {1000 * seconds / max(steps, 1):>8.2f} "
            f"{count / seconds:>9,.0f} {100 * forward / seconds:>7.0f}%"
        )
    same = runs["in place"][1] == runs["transformers cache"][1]
    ratio = runs["transformers cache"][0] / runs["in place"][0]
    print(f"same tokens: {'yes' if same else 'NO'}; in place is {ratio:.2f}x faster")
    if not same:
        raise SystemExit("the two modes gave different tokens")


if __name__ == "__main__":
    main()
