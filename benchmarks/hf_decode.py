"""The transformers engine's decode rate on long branches: its batching against simpler ways.

Starts ``--requests`` long-testbed questions with ``--n`` branches each
(temperature 1, up to ``--max-tokens``), request ``r`` after ``r x --stagger``
steps (so that, as under load, branches of different lengths decode together),
decodes ``--steps`` steps, and reports per mode the wall time per step, the
tokens per second, the model forward's share and the forwards per step. The
modes run side by side on one model, same seeds:

- ``split by length`` (the engine's default): a step batch kept between steps,
  the new token written into it (``sart.engines.hf_kv``), and the rows split
  into batches by length where the padding saved pays for a forward
  (``HFEngine.split_cost``);
- ``one batch``: the same without the split (``split_cost = None``);
- ``transformers cache``: one batch rebuilt every step and handed to
  transformers' ``DynamicCache``, which copies it (``HFEngine.in_place = False``,
  as for a model with sliding-window layers).
- ``own buffers``: one batch in buffers the engine owns, padded to buckets of
  rows and columns, the forward replayed as a CUDA graph on a GPU
  (``--cuda-graphs``, ``sart.engines.hf_graphs``); on a CPU the same forward, not
  captured.

All must give the same tokens; the script says so.

    OMP_NUM_THREADS=1 python benchmarks/hf_decode.py                 # 4 x 8 branches, 1,000 steps
    OMP_NUM_THREADS=1 python benchmarks/hf_decode.py --stagger 300   # arriving 300 steps apart
    OMP_NUM_THREADS=1 python benchmarks/hf_decode.py --steps 20      # seconds: a smoke run
    python benchmarks/hf_decode.py --device cuda                     # on a GPU
"""

from __future__ import annotations

import argparse
import time

import torch

from sart.engines.hf import HFEngine
from sart.engines.hf_graphs import StaticDecode
from sart.messages import BranchSpec
from sart.testbed import LONG, make_questions
from sart.types import SamplingSettings

MODES = (  # name, in place, split by length, over the engine's own buffers
    ("split by length", True, True, False),
    ("one batch", True, False, False),
    ("transformers cache", False, False, False),
    ("own buffers", True, False, True),
)


def decode(engine: HFEngine, args: argparse.Namespace) -> tuple:
    """Seconds, forward seconds, forwards, steps and the tokens of one run."""
    questions = make_questions(1, args.requests, LONG.difficulties, cycle=LONG.cycle)
    settings = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens)
    arrivals: dict[int, list[int]] = {}
    for r in range(args.requests):
        arrivals.setdefault(r * args.stagger, []).append(r)
    tokens: dict[object, list[int]] = {}
    forwards = [0]
    forward = engine._forward

    def counted(*a: object, **k: object) -> object:
        forwards[0] += 1
        return forward(*a, **k)

    engine._forward = counted  # type: ignore[method-assign]
    engine.forward_seconds = 0.0
    started = time.perf_counter()
    done = 0
    while done < args.steps:
        for r in arrivals.pop(done, []):
            engine.prefill(f"r{r}", questions[r].prompt, settings)
            engine.start_branches(f"r{r}", [BranchSpec(index=i, seed=i) for i in range(args.n)])
        later = list(arrivals)
        if not engine.stats().live_branches:
            if not later:
                break
            done = min(later)  # idle until the next arrival
            continue
        out = engine.step(min(50, args.steps - done, *(at - done for at in later)))
        done += out.steps
        for bid, delta in out.deltas.items():
            tokens.setdefault(bid, []).extend(delta.token_ids)
    seconds = time.perf_counter() - started
    engine._forward = forward  # type: ignore[method-assign]
    for r in range(args.requests):
        if f"r{r}" in engine.prefixes:  # not those that never arrived
            engine.release_prefix(f"r{r}")
    if engine.static is not None:  # a step's forward goes by the buffers, not _forward
        forwards[0] += done
    return seconds, engine.forward_seconds, forwards[0], done, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--stagger", type=int, default=0, help="steps between requests")
    parser.add_argument("--max-tokens", type=int, default=LONG.max_tokens)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--device", default="cpu", help="torch device (own buffers: graphs on cuda)"
    )
    parser.add_argument(
        "--split-cost", type=int, default=None, help="in place of the engine's estimate"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = HFEngine.from_pretrained(str(LONG.policy_path), device=args.device)
    default_cost = engine.split_cost if args.split_cost is None else args.split_cost
    warm = argparse.Namespace(**{**vars(args), "steps": min(args.steps, 20), "stagger": 0})
    decode(engine, warm)  # the first forwards allocate: not the first mode's cost
    print(
        f"long testbed, {args.requests} requests x {args.n} branches, {args.steps} steps, "
        f"{args.stagger} steps apart (max_tokens {args.max_tokens}), torch threads "
        f"{args.threads}, split cost {default_cost}"
    )
    print(
        f"{'mode':>20} {'steps':>6} {'ms/step':>8} {'tokens/s':>9} {'forward':>8} {'fwd/step':>8}"
    )
    runs = {}
    for mode, in_place, split, static in MODES:
        engine.in_place = in_place
        engine.split_cost = default_cost if split else None
        engine.static = StaticDecode(engine.model) if static else None  # graphs on a GPU
        seconds, forward, forwards, steps, tokens = decode(engine, args)
        count = sum(len(t) for t in tokens.values())
        runs[mode] = (seconds, tokens)
        print(
            f"{mode:>20} {steps:>6} {1000 * seconds / max(steps, 1):>8.2f} "
            f"{count / seconds:>9,.0f} {100 * forward / seconds:>7.0f}% "
            f"{forwards / max(steps, 1):>8.2f}"
        )
    first, *others = (mode for mode, *_ in MODES)
    same = all(runs[mode][1] == runs[first][1] for mode in others)
    ratios = ", ".join(f"{runs[mode][0] / runs[first][0]:.2f}x {mode}'s" for mode in others)
    print(f"same tokens: {'yes' if same else 'NO'}; {first} is faster by {ratios}")
    if not same:
        raise SystemExit("the modes gave different tokens")


if __name__ == "__main__":
    main()
