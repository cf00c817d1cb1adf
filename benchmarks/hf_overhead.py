"""Where a decode step's time goes on the transformers engine: model forward vs the rest.

Serves the demo prompts with SART (n=4) on the tiny demo policy (built into a
temporary directory), with a scripted PRM so that PRM time is excluded, and
splits wall time into: the model's forward passes, the engine's own work
(repacking caches into a batch, sampling, detokenizing), and sart's
scheduler + driver. Reported per decode step.

    python benchmarks/hf_overhead.py [--n 4] [--max-tokens 64] [--interval 16] [--threads 2]
    python benchmarks/hf_overhead.py --n 2 --max-tokens 16 --threads 1   # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

import sart
from sart.bench.real import load_prompts
from sart.demo_models import build_demo_models
from sart.engines.hf import HFEngine
from sart.testing import ScriptedPRM

sys.path.insert(0, str(Path(__file__).parent))
from scheduler_overhead import TimedScheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--interval", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = build_demo_models(tempfile.mkdtemp())
    engine = HFEngine.from_pretrained(str(paths["policy"]), dtype=torch.float32)
    items = load_prompts(paths["prompts"])
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=args.max_tokens)
    policy = sart.sart(args.n, interval=args.interval)
    driver = sart.SyncDriver(engine, ScriptedPRM(every=args.interval), batch_size=args.batch_size)
    timed = TimedScheduler(driver.scheduler)
    driver.scheduler = timed  # type: ignore[assignment]
    requests = [sart.Request(i.id, i.prompt, policy, sampling=sampling) for i in items]
    wall = time.perf_counter()
    driver.run(requests)
    wall = time.perf_counter() - wall
    steps = timed.statistics().step
    forward = engine.forward_seconds
    scheduler = timed.seconds
    rest = wall - forward - scheduler
    print(
        f"{len(items)} requests, SART n={args.n}, B={args.batch_size}, T={args.interval}, "
        f"max_tokens={args.max_tokens}: {steps} decode steps in {wall:.2f} s"
    )
    print(f"{'part':>28} {'ms/step':>8} {'share':>6}")
    for name, seconds in [
        ("model forward", forward),
        ("engine (repack, sample, text)", rest),
        ("sart scheduler", scheduler),
    ]:
        print(f"{name:>28} {1e3 * seconds / steps:>8.3f} {seconds / wall:>6.1%}")


if __name__ == "__main__":
    main()
