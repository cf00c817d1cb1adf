"""How much PRM hardware SART needs at scale: SC / SART P97 against PRM allocations, simulated.

For each policy layout (``--layouts``: the paper's 8 H100s as one TP8 engine,
``8xh100-14b-tp8``, or as 8 data-parallel replicas, ``h100-14b x8``), workload
and rate, it serves the same trace with SC and SART at ``N`` branches on the
simulator (``sart bench``'s runner), once with a free PRM and once per PRM
allocation: how each check is priced (``reencode``: vLLM's STEP-pooled PRM,
the whole input at every check; ``incremental``: sart's transformers PRM;
``cached``: sart's LAST-pooled vLLM PRM on the prefix cache) and how many PRM
replicas (one H100 each, per engine replica; as many checks in flight). It
prints SC / SART at P97 for each, its fraction of the free-PRM ratio, and the
smallest allocation (fewest PRM GPUs, then the cheapest pricing) within
``--target`` (15%) of the free ratio at every rate.

    python benchmarks/prm_capacity.py                 # the full sweep (a few minutes)
    python benchmarks/prm_capacity.py --quick         # a small one, for CI

The numbers are the simulator's (``sart.engines.costs``, ``sart.engines.prm_costs``):
a plan, not a measurement of real GPUs.
"""

from __future__ import annotations

import argparse
import time

import attrs

from sart.bench.runner import BenchConfig, run_bench

LAYOUTS = {
    # name -> (cost preset, engine replicas)
    "tp8": ("8xh100-14b-tp8", 1),
    "dp8": ("h100-14b", 8),
}
PRICINGS = ("reencode", "incremental", "cached")


@attrs.frozen
class Cell:
    layout: str
    workload: str
    pricing: str
    replicas: int
    ratios: dict[float, float]
    """rate -> SC / SART at P97."""
    tokens: dict[float, float]
    """rate -> SART's tokens per request."""


def measure(
    layout: str, workload: str, pricing: str, replicas: int, args: argparse.Namespace
) -> Cell:
    cost, engine_replicas = LAYOUTS[layout]
    config = BenchConfig(
        workload=workload,
        cost=cost,
        replicas=engine_replicas,
        methods=("sc", "sart"),
        ns=(args.n,),
        rates=tuple(args.rates),
        num_requests=args.requests,
        seed=args.seed,
        prm_cost=pricing,
        prm_replicas=replicas,
    )
    records = run_bench(config)
    p97 = {(r.rate, r.method): r.summary.e2e.p97 for r in records}
    tokens = {r.rate: r.summary.tokens_per_request for r in records if r.method == "sart"}
    ratios = {rate: p97[(rate, "sc")] / p97[(rate, "sart")] for rate in args.rates}
    return Cell(layout, workload, pricing, replicas, ratios, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["tp8", "dp8"])
    parser.add_argument("--workloads", nargs="+", default=["gaokao", "gpqa"])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--pricings", nargs="+", choices=PRICINGS, default=list(PRICINGS))
    parser.add_argument("--target", type=float, default=0.15, help="largest loss vs free PRM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="tp8, gaokao, 4 req/s, 40 requests, 1-2 replicas"
    )
    args = parser.parse_args()
    if args.quick:
        args.layouts, args.workloads, args.rates = ["tp8"], ["gaokao"], [4.0]
        args.requests, args.replicas = 40, [1, 2]
    started = time.perf_counter()
    rates = " ".join(f"{r:g}" for r in args.rates)
    print(f"SC / SART at P97, N = {args.n}, {args.requests} requests, rates {rates} req/s")
    for layout in args.layouts:
        for workload in args.workloads:
            free = measure(layout, workload, "free", 1, args)
            print(f"\n{layout}, {workload}")
            header = "  ".join(f"{r:>5g} r/s  of free" for r in args.rates)
            print(f"  {'PRM':<22} {header}   SART tokens/req")
            shown = "  ".join(f"{free.ratios[r]:>9.2f}  {'':>7}" for r in args.rates)
            tokens = " / ".join(f"{free.tokens[r]:,.0f}" for r in args.rates)
            print(f"  {'free':<22} {shown}   {tokens}")
            best: tuple[int, int, str] | None = None
            for pricing in args.pricings:
                for replicas in args.replicas:
                    cell = measure(layout, workload, pricing, replicas, args)
                    fractions = {r: cell.ratios[r] / free.ratios[r] for r in args.rates}
                    shown = "  ".join(
                        f"{cell.ratios[r]:>9.2f}  {fractions[r]:>6.0%}" for r in args.rates
                    )
                    tokens = " / ".join(f"{cell.tokens[r]:,.0f}" for r in args.rates)
                    gpus = replicas * LAYOUTS[layout][1]
                    label = f"{pricing}, {replicas} x H100"
                    print(f"  {label:<22} {shown}   {tokens}")
                    if all(f >= 1 - args.target for f in fractions.values()):
                        key = (gpus, PRICINGS.index(pricing), label)
                        best = key if best is None or key < best else best
            if best is None:
                print(f"  no allocation here is within {args.target:.0%} of the free PRM")
            else:
                print(
                    f"  smallest within {args.target:.0%} of free: {best[2]} per engine replica "
                    f"({best[0]} PRM GPU{'s' if best[0] > 1 else ''} in all)"
                )
    print(f"\ntook {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
