"""Workloads resampled from a recorded trace: many requests at any rate from a few hundred.

``ResampledWorkload`` takes a trace recorded on a real model (``sart bench
--record-trace``: every branch run to its end, PRM rewards every ``T``) and
generates workloads like the presets do (``sart.bench.workloads``): Poisson
arrivals at the asked rate, ``n`` branches per request. Each generated
request is a recorded one, drawn uniformly with replacement, and its ``n``
branches are drawn from that request's recorded branches: without replacement
when it has at least ``n``, else with replacement (so a branch may repeat).

What it keeps: everything that lives within a request — its gold answer,
prompt length, how spread its branches' lengths are, which branches are
right, how the PRM's rewards track them over time — because whole recorded
requests are reused, never mixed. What it does not make: requests unlike
the recorded ones (no smoothing or extrapolation; with few recorded requests
the same ones come back often), nor branches longer than recorded (the
model's ``max_tokens`` is the longest recorded branch).

Rewards were recorded every ``T`` tokens; a workload at ``interval`` keeps every
``interval / T``-th of them, so ``interval`` must be a multiple of the recorded
``T``. Deterministic for a seed: request ``i``'s draw depends only on the seed
and ``i``, as in the presets (common random numbers across sweeps of ``n``).
"""

from __future__ import annotations

import functools
import random
import statistics
from pathlib import Path

import attrs

from sart.bench.traces import Trace, TraceRequest
from sart.engines.scripts import BranchScript
from sart.errors import ConfigError, config_check


@attrs.frozen
class ResampledWorkload:
    """A workload drawn from ``source`` (see the module docstring)."""

    name: str
    source: Trace = attrs.field(eq=False, repr=False)
    recorded_interval: int
    max_tokens: int
    """The longest recorded branch."""
    median_length: float
    prompt_tokens: int
    """The mean recorded prompt length (what the branch budget is sized from)."""

    @classmethod
    def of(cls, trace: Trace, name: str = "trace") -> ResampledWorkload:
        interval = trace.interval
        if interval is None:
            raise ConfigError(
                f"workload {name!r}: its requests do not all record one interval T "
                "(record it with sart bench --record-trace)"
            )
        lengths = [b.length for r in trace for b in r.branches]
        return cls(
            name=name,
            source=trace,
            recorded_interval=interval,
            max_tokens=max(lengths),
            median_length=float(statistics.median(lengths)),
            prompt_tokens=round(statistics.fmean(r.prompt_tokens for r in trace)),
        )

    def generate(
        self, num_requests: int, rate: float, n: int, interval: int, seed: int = 0
    ) -> Trace:
        """``num_requests`` requests with Poisson arrivals at ``rate`` per second, ``n``
        branches each, rewards every ``interval`` tokens (a multiple of the recorded T)."""
        config_check(num_requests >= 1, "num_requests", num_requests, ">= 1")
        config_check(rate > 0, "rate", rate, "> 0")
        config_check(n >= 1, "n", n, ">= 1")
        config_check(
            interval >= 1 and interval % self.recorded_interval == 0,
            "interval",
            interval,
            f"a multiple of the trace's recorded T={self.recorded_interval}",
        )
        every = interval // self.recorded_interval
        arrivals = random.Random(f"{self.name}/{seed}/{rate}/arrivals")
        arrival = 0.0
        requests = []
        for i in range(num_requests):
            arrival += arrivals.expovariate(rate)
            rng = random.Random(f"{self.name}/{seed}/{i}")
            recorded = rng.choice(self.source.requests)
            pool = recorded.branches
            picked = rng.sample(pool, n) if len(pool) >= n else rng.choices(pool, k=n)
            requests.append(
                TraceRequest(
                    id=f"r{i}",
                    arrival=round(arrival, 6),
                    answer=recorded.answer,
                    branches=tuple(_every(b, every) for b in picked),
                    prompt_tokens=recorded.prompt_tokens,
                    interval=interval,
                )
            )
        # The source's replay settings (a generated preset's, from its header) carry over.
        source = self.source
        return Trace.of(requests, persistence=source.persistence, fork_model=source.fork_model)


def _every(branch: BranchScript, every: int) -> BranchScript:
    """The branch with the rewards of every ``every``-th check (checks at k x T')."""
    return attrs.evolve(branch, rewards=branch.rewards[every - 1 :: every])


@functools.lru_cache(maxsize=8)
def load_resampled(path: str) -> ResampledWorkload:
    """The workload of a trace file (loaded once per path and process)."""
    return ResampledWorkload.of(Trace.load(path), name=Path(path).name)
