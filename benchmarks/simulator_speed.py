"""How fast the simulator runs: requests simulated per second of wall time.

Generates a workload of 10,000 requests with N=8 branches each, then serves
it with SART (and optionally the other methods) on SimEngine under the given
cost preset, with the PRM priced as ``sart bench`` prices it by default,
timing trace generation and simulation separately.

    python benchmarks/simulator_speed.py                       # SART, 10k requests, N=8
    python benchmarks/simulator_speed.py --methods sart sc --requests 2000
"""

from __future__ import annotations

import argparse
import time

from sart.bench.runner import BenchConfig, run_method
from sart.bench.workloads import workload
from sart.methods import method_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", default="h100-14b")
    parser.add_argument("--workload", default="gaokao")
    parser.add_argument("--methods", nargs="+", default=["sart"], choices=method_names())
    args = parser.parse_args()
    config = BenchConfig(
        workload=args.workload,
        cost=args.model,
        ns=(args.n,),
        rates=(args.rate,),
        num_requests=args.requests,
        batch_size=args.batch_size,
    )
    start = time.perf_counter()
    trace = workload(args.workload).generate(args.requests, args.rate, args.n, config.interval)
    generated = time.perf_counter() - start
    print(f"generated {args.requests} requests x {args.n} branches in {generated:.1f} s")
    print(
        f"{'method':>14} {'wall s':>8} {'requests/s':>11} {'decode calls':>13} {'sim time s':>11}"
    )
    for method in args.methods:
        start = time.perf_counter()
        record = run_method(trace, method, args.n, config, args.rate)
        wall = time.perf_counter() - start
        calls = len(record.timeline)
        print(
            f"{method:>14} {wall:>8.1f} {args.requests / wall:>11,.0f} {calls:>13,} "
            f"{record.summary.makespan:>11,.0f}"
        )


if __name__ == "__main__":
    main()
