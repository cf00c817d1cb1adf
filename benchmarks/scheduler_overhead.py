"""Scheduler + policy overhead per decode step, on the fake engine.

Runs SART (n=8, paper defaults) on scripted branches with the synchronous
driver and times only the scheduler's own calls (``next_commands`` and
``handle``, which run every policy hook: pruning, stop rules, selection).
Engine and PRM time are excluded, so this is the cost sart adds on top of a
zero-cost engine. Reported as microseconds per decode step, for several
batch budgets B (all B slots are kept busy) and check intervals T.

    python benchmarks/scheduler_overhead.py                 # B = 64, 256, 1024; T = 400, 16
    python benchmarks/scheduler_overhead.py --batch-sizes 256 --intervals 1

Target (issue 2): <= 250 us per step at B = 256, i.e. 1% of a 25 ms decode step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import sart
from sart.testing import FakeEngine, ScriptedPRM, random_scripts


class TimedScheduler:
    """Wraps the driver's scheduler and accumulates the time spent inside it.

    Times ``submit``, ``next_commands`` and ``handle``; everything else the driver
    reads (``config``, ``next_deadline``, ``cancel``, ``running_request_ids``, ...)
    is passed through to the wrapped scheduler untimed, so that the wrapper keeps
    working when the driver starts using another part of the scheduler."""

    def __init__(self, inner: sart.Scheduler) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        # Only called for what this class does not define itself.
        if name == "inner":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def submit(self, request: sart.Request) -> None:
        self._timed(self.inner.submit, request)

    def next_commands(self, now: float) -> list:
        return self._timed(self.inner.next_commands, now)

    def handle(self, events: list, now: float) -> None:
        self._timed(self.inner.handle, events, now)

    def statistics(self) -> sart.SchedulerStats:
        return self.inner.statistics()


def measure(batch_size: int, interval: int, n: int, median_length: int, seed: int) -> dict:
    script = random_scripts(seed=seed, median_length=median_length, every=interval)
    engine = FakeEngine(script)
    prm = ScriptedPRM(script, every=interval)
    driver = sart.SyncDriver(engine, prm, batch_size=batch_size)
    timed = TimedScheduler(driver.scheduler)
    driver.scheduler = timed  # type: ignore[assignment]
    policy = sart.sart(n, interval=interval)
    sampling = sart.SamplingSettings(max_tokens=8 * median_length)
    num_requests = 4 * batch_size // n  # every request arrives at 0: the batch stays full
    requests = [
        sart.Request(f"r{i}", "prompt", policy, sampling=sampling) for i in range(num_requests)
    ]
    wall = time.perf_counter()
    results = driver.run(requests)
    wall = time.perf_counter() - wall
    steps = timed.statistics().step
    assert all(r.ok for r in results)
    return {
        "B": batch_size,
        "T": interval,
        "requests": num_requests,
        "steps": steps,
        "us_per_step": 1e6 * timed.seconds / steps,
        "wall_s": wall,
        "peak_live": engine.peak_live,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--intervals", type=int, nargs="+", default=[400, 16])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--median-length", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    header = ("B", 5), ("T", 4), ("requests", 8), ("steps", 7), ("us/step", 9), ("peak", 5)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'wall s':>7}")
    for interval in args.intervals:
        for batch_size in args.batch_sizes:
            r = measure(batch_size, interval, args.n, args.median_length, args.seed)
            print(
                f"{r['B']:>5} {r['T']:>4} {r['requests']:>8} {r['steps']:>7} "
                f"{r['us_per_step']:>9.1f} {r['peak_live']:>5} {r['wall_s']:>7.2f}"
            )


if __name__ == "__main__":
    main()
