"""``sart tune``: search SART's hyper-parameters on the simulator for a workload and a rate.

The paper leaves ``N``, ``M``, ``alpha``, ``beta`` and ``T`` to the user (its
first limitation), and they interact with load and with the workload's
length spread. ``tune`` runs every candidate of a grid (``search_space``) on a
*tuning* trace, keeps those whose accuracy reaches the target (by default
Self-Consistency's at the same ``N`` minus one point), picks the one with the
lowest P97 end-to-end latency, and then serves the winner, the paper's
defaults (``M = beta = N/2``, ``alpha = 0.5``, ``T = 400``) and
Self-Consistency on a *held-out* trace: the same workload at the same rate,
drawn with another seed, so the reported numbers are not the ones the search
chose on. It also returns the tuning runs' Pareto front of accuracy against
P97.

Traces for different ``T`` come from the same seed: the workload draws each
branch's length and answer before its rewards (``sart.bench.workloads``), so
every ``T`` sees the same requests and branches, and only where the PRM reads
them changes. Runs are independent and deterministic; they are spread over
``jobs`` processes. Each finished run is handed to ``on_run`` as a ``Trial``, and
the ``Trial`` values given as ``done`` are not run again: that is how
``sart tune --resume`` goes on from an interrupted tune, to the same result.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import attrs

from sart.bench.runner import BenchConfig, RunRecord, run_method
from sart.bench.traces import Trace
from sart.bench.workloads import workload
from sart.errors import ConfigError, config_check
from sart.metrics import wilson_interval
from sart.policies.base import Policy
from sart.policies.recipes import sart

ALPHAS = (0.3, 0.5, 0.7)
INTERVALS = (200, 400, 800)
PAPER_INTERVAL = 400
SLACK = 0.01
"""How far below Self-Consistency's accuracy a configuration may be (``tune``'s ``slack``)."""
HELD_OUT_SEED_OFFSET = 1_000_003
"""The held-out trace's seed is the tuning seed plus this (another Poisson stream)."""


@attrs.frozen(order=True)
class Candidate:
    """One SART configuration."""

    n: int
    m: int
    alpha: float
    beta: int
    interval: int

    @classmethod
    def paper(cls, n: int) -> Candidate:
        """The paper's defaults at ``n`` branches (section 5.1)."""
        return cls(n, max(1, n // 2), 0.5, n // 2, PAPER_INTERVAL)

    def policy(self) -> Policy:
        return sart(self.n, m=self.m, alpha=self.alpha, beta=self.beta, interval=self.interval)

    def code(self) -> str:
        """The line of Python that builds this policy."""
        return (
            f"sart.sart({self.n}, m={self.m}, alpha={self.alpha}, beta={self.beta}, "
            f"interval={self.interval})"
        )


@attrs.frozen
class Score:
    """What one run of a configuration gave."""

    candidate: Candidate | None
    """``None``: Self-Consistency at ``n``."""
    n: int
    p97: float
    accuracy: float
    tokens: float
    """Generated tokens per request."""
    requests: int = 0
    """Requests graded (failed ones as wrong): the accuracy's sample size."""

    @property
    def interval(self) -> tuple[float, float]:
        """The accuracy's 95% Wilson interval over ``requests``."""
        return wilson_interval(round(self.accuracy * self.requests), self.requests)

    @property
    def label(self) -> str:
        return f"sc(n={self.n})" if self.candidate is None else self.candidate.code()


def search_space(
    ns: Sequence[int],
    alphas: Sequence[float] = ALPHAS,
    intervals: Sequence[int] = INTERVALS,
) -> list[Candidate]:
    """The grid: for each ``N``, ``M`` in {N/4, N/2, 3N/4}, ``beta`` in {N/4, N/2} (each
    at least 1, duplicates dropped), every ``alpha`` and every ``T``. The paper's
    defaults are always in it."""
    out: set[Candidate] = set()
    for n in ns:
        config_check(n >= 2, "n", n, ">= 2 (SART with one branch has nothing to prune)")
        ms = {max(1, n // 4), max(1, n // 2), max(1, 3 * n // 4)}
        betas = {max(1, n // 4), max(1, n // 2)}
        for m in ms:
            for beta in betas:
                for alpha in alphas:
                    for interval in intervals:
                        out.add(Candidate(n, m, alpha, beta, interval))
        out.add(Candidate.paper(n))
    return sorted(out)


def make_traces(
    config: BenchConfig, rate: float, width: int, intervals: Iterable[int], seed: int
) -> dict[int, Trace]:
    """One trace per ``T`` of the configured workload (same seed: same branches)."""
    assert config.workload is not None and config.num_requests is not None
    model = workload(config.workload)
    return {t: model.generate(config.num_requests, rate, width, t, seed) for t in intervals}


def _score(record: RunRecord, candidate: Candidate | None) -> Score:
    summary = record.summary
    if summary.accuracy is None:
        raise ConfigError("tuning needs gold answers (the workload has them)")
    return Score(
        candidate,
        record.n,
        summary.e2e.p97,
        summary.accuracy,
        summary.tokens_per_request,
        len(record.results),
    )


TraceName = Literal["tuning", "held-out"]
TrialKey = tuple[str, Candidate | None, int]


@attrs.frozen
class Trial:
    """One finished run of a tune: which trace it ran on, and what it gave."""

    trace: TraceName
    score: Score

    @property
    def key(self) -> TrialKey:
        """Which run of the tune this is: its trace, configuration (``None``: SC) and ``N``."""
        return (self.trace, self.score.candidate, self.score.n)


_Job = tuple[Candidate | None, int, int]
"""A run to do: its configuration (``None``: SC), ``N`` and the ``T`` of its trace."""
_Shared = tuple[dict[int, Trace], BenchConfig, float]
"""What every run of one ``evaluate`` shares: the traces by ``T``, the configuration, the rate."""

# Set once in each worker process: a trace is large, and sent with each of 108 runs it
# would be pickled 108 times.
_shared: _Shared | None = None


def _share(traces: dict[int, Trace], config: BenchConfig, rate: float) -> None:
    global _shared
    _shared = (traces, config, rate)


def _run_in_worker(job: _Job) -> Score:
    assert _shared is not None
    return _run(_shared, job)


def _run(shared: _Shared, job: _Job) -> Score:
    traces, config, rate = shared
    candidate, n, interval = job
    if candidate is None:
        record = run_method(traces[interval], "sc", n, config, rate)
    else:
        policy = candidate.policy()
        record = run_method(traces[interval], "sart", n, config, rate, policy=policy)
    return _score(record, candidate)


def evaluate(
    candidates: Sequence[Candidate | None],
    ns: Sequence[int],
    traces: dict[int, Trace],
    config: BenchConfig,
    rate: float,
    jobs: int = 1,
    *,
    trace: TraceName = "tuning",
    done: dict[TrialKey, Score] | None = None,
    on_run: Callable[[Trial], None] | None = None,
) -> list[Score]:
    """Each candidate (``None``: Self-Consistency at the matching entry of ``ns``) run
    on its ``T``'s trace (SC on the paper's ``T``), in input order. The runs ``done``
    holds (by ``Trial.key`` on ``trace``) are not run again; each other one is handed
    to ``on_run`` as it finishes."""
    work: list[_Job] = [
        (candidate, n, PAPER_INTERVAL if candidate is None else candidate.interval)
        for candidate, n in zip(candidates, ns, strict=True)
    ]
    scores: dict[int, Score] = {}
    for i, (candidate, n, _) in enumerate(work):
        if done and (trace, candidate, n) in done:
            scores[i] = done[(trace, candidate, n)]

    def finished(i: int, score: Score) -> None:
        scores[i] = score
        if on_run is not None:
            on_run(Trial(trace, score))

    todo = [i for i in range(len(work)) if i not in scores]
    shared = (traces, config, rate)
    if jobs <= 1 or len(todo) <= 1:
        for i in todo:
            finished(i, _run(shared, work[i]))
    else:
        _run_in_processes(work, todo, jobs, shared, finished)
    return [scores[i] for i in range(len(work))]


def _run_in_processes(
    work: list[_Job],
    todo: list[int],
    jobs: int,
    shared: _Shared,
    finished: Callable[[int, Score], None],
) -> None:
    """``work[i]`` for each ``i`` of ``todo`` over ``jobs`` processes, each handed to
    ``finished`` as it ends. Interrupted (or failing), the runs not started are dropped,
    and those running are waited for and handed on too: they are finished runs to keep."""
    with concurrent.futures.ProcessPoolExecutor(jobs, initializer=_share, initargs=shared) as pool:
        futures = {pool.submit(_run_in_worker, work[i]): i for i in todo}
        handed: set[concurrent.futures.Future[Score]] = set()
        try:
            for future in concurrent.futures.as_completed(futures):
                handed.add(future)
                finished(futures[future], future.result())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            for future, i in futures.items():
                ended = future.done() and not future.cancelled() and future not in handed
                if ended and future.exception() is None:
                    finished(i, future.result())
            raise


def pareto(scores: Iterable[Score]) -> list[Score]:
    """The scores no other beats on both accuracy (higher) and P97 (lower), by P97."""
    front: list[Score] = []
    for score in sorted(scores, key=lambda s: (s.p97, -s.accuracy)):
        if not front or score.accuracy > front[-1].accuracy:
            front.append(score)
    return front


def choose(scores: Sequence[Score], targets: dict[int, float]) -> Score | None:
    """The lowest-P97 score whose accuracy reaches its ``N``'s target (ties: the
    higher accuracy, then the grid order); ``None`` if none does."""
    feasible = [s for s in scores if s.accuracy >= targets[s.n] - 1e-12]
    if not feasible:
        return None
    return min(feasible, key=lambda s: (s.p97, -s.accuracy, s.candidate))


@attrs.frozen
class TuneResult:
    """A tune: the tuning runs and the held-out comparison."""

    rate: float
    targets: dict[int, float]
    """Accuracy each ``N`` had to reach (on the tuning trace)."""
    tuning: tuple[Score, ...]
    tuning_sc: tuple[Score, ...]
    front: tuple[Score, ...]
    winner: Score | None
    """On the tuning trace; ``None`` if no configuration reached its target."""
    held_out: tuple[Score, ...]
    """On the held-out trace: SC and the paper's defaults at every ``N``, and the winner."""
    floors: dict[int, float] = attrs.field(factory=dict)
    """The accuracy each ``N`` must reach on the held-out trace: ``min_accuracy``, else
    SC's held-out accuracy at that ``N`` less the ``slack`` (as the tuning targets)."""

    def held_out_of(self, candidate: Candidate | None, n: int) -> Score:
        return next(s for s in self.held_out if s.candidate == candidate and s.n == n)

    def meets(self, score: Score) -> bool:
        """Whether a held-out score reaches its ``N``'s held-out accuracy floor."""
        return score.accuracy >= self.floors.get(score.n, 0.0) - 1e-12


def tune(
    config: BenchConfig,
    rate: float,
    ns: Sequence[int],
    *,
    min_accuracy: float | None = None,
    slack: float = SLACK,
    space: Sequence[Candidate] | None = None,
    intervals: Sequence[int] = INTERVALS,
    jobs: int = 1,
    done: Iterable[Trial] = (),
    on_run: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """Search ``space`` (default ``search_space(ns, intervals=intervals)``) at ``rate``
    (see the module docstring). The target is ``min_accuracy`` if given, else SC's
    tuning accuracy at the same ``N`` minus ``slack``. The runs of ``done`` (those an
    interrupted tune of the same arguments finished) are kept, not run again; every
    other run is handed to ``on_run`` as it finishes."""
    kept = {trial.key: trial.score for trial in done}
    ns = sorted(set(ns))
    space = list(space) if space is not None else search_space(ns, intervals=intervals)
    config_check(bool(space), "space", space, "non-empty")
    intervals = sorted({c.interval for c in space} | {PAPER_INTERVAL})
    width = max(ns + [c.n for c in space])
    tuning_traces = make_traces(config, rate, width, intervals, config.seed)
    sc = evaluate([None] * len(ns), ns, tuning_traces, config, rate, jobs, done=kept, on_run=on_run)
    targets = {s.n: s.accuracy - slack if min_accuracy is None else min_accuracy for s in sc}
    for c in space:
        targets.setdefault(c.n, min_accuracy if min_accuracy is not None else 0.0)
    tuning = evaluate(
        space, [c.n for c in space], tuning_traces, config, rate, jobs, done=kept, on_run=on_run
    )
    winner = choose(tuning, targets)
    held_traces = make_traces(config, rate, width, intervals, config.seed + HELD_OUT_SEED_OFFSET)
    held: list[Candidate | None] = [None] * len(ns) + [Candidate.paper(n) for n in ns]
    held_ns = list(ns) * 2
    if winner is not None and winner.candidate not in held:
        held.append(winner.candidate)
        held_ns.append(winner.n)
    held_out = evaluate(
        held, held_ns, held_traces, config, rate, jobs, trace="held-out", done=kept, on_run=on_run
    )
    floors = {
        s.n: s.accuracy - slack if min_accuracy is None else min_accuracy
        for s in held_out
        if s.candidate is None
    }
    return TuneResult(
        rate=rate,
        targets=targets,
        tuning=tuple(tuning),
        tuning_sc=tuple(sc),
        front=tuple(pareto(tuning)),
        winner=winner,
        held_out=tuple(held_out),
        floors=floors,
    )


def result_json(result: TuneResult) -> dict[str, object]:
    def row(score: Score) -> dict[str, object]:
        return {
            "policy": score.label,
            "config": None if score.candidate is None else attrs.asdict(score.candidate),
            "n": score.n,
            "p97": score.p97,
            "accuracy": score.accuracy,
            "accuracy_ci95": list(score.interval),
            "requests": score.requests,
            "tokens_per_request": score.tokens,
        }

    return {
        "rate": result.rate,
        "targets": {str(n): t for n, t in result.targets.items()},
        "winner": None if result.winner is None else row(result.winner),
        "held_out": [{**row(s), "meets_floor": result.meets(s)} for s in result.held_out],
        "held_out_floors": {str(n): f for n, f in result.floors.items()},
        "pareto_front": [row(s) for s in result.front],
        "tuning": [row(s) for s in result.tuning],
        "tuning_sc": [row(s) for s in result.tuning_sc],
    }
