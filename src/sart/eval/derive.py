"""Every method's answers and latencies at every ``N``, derived from one recorded pass.

A recorded problem holds ``n`` branches run to their end, each with its
length, its answer and its PRM rewards every ``T`` tokens. A method with
``N <= n`` branches would have sampled the first ``N`` of them (branch ``j``
is seeded ``seed + j`` whatever the method), read the same rewards at the
same token counts, and stopped, pruned and selected by them. So replaying the
first ``N`` recorded branches through the simulator (``SimEngine`` +
``ScriptedPRM``, as ``sart bench --trace`` does) gives the method's answer
for each problem, its tokens, and, on a named cost model, its latency under
the given arrivals. Vanilla is ``N = 1``.

What the replay does not reproduce: Rebase forks new branches from partial
ones, and a fork's continuation is drawn from the recorded branches
(``TraceScript.fork``), an approximation; and a real PRM's reward of a branch
at ``k * T`` tokens is the recorded one only up to numerical noise.

The selected answer is graded by the recorded grade of a branch with that
answer (``ProblemRecord.correct_answer``), which is what grading it again
with the dataset's grader gives. Votes (Self-Consistency's majority,
Rebase's weighted vote) group answers under the equivalence the caller gives
(``MathVerifyEquivalence`` for math).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from sart.bench.real import PolicyFactory, arrivals
from sart.bench.runner import BenchConfig, plan, run_method
from sart.bench.traces import Trace
from sart.eval.accuracy import EvalRun
from sart.eval.grading import Grader, grade_answer
from sart.eval.problems_file import ProblemRecord
from sart.results import RequestResult

_BOX = "\\boxed{"


def unboxed(text: str) -> str:
    """A replayed branch's answer: the simulator's text of a recorded branch is exactly
    ``\\boxed{answer}`` (read back whole, whatever braces the answer holds)."""
    if text.startswith(_BOX) and text.endswith("}"):
        return text[len(_BOX) : -1]
    return text


def replay_trace(records: Sequence[ProblemRecord], rate: float, seed: int) -> Trace:
    """The recorded problems as one trace, in the given order, arriving as a Poisson
    process at ``rate`` per second (``sart.bench.real.arrivals``: the first ``k``
    arrival times do not depend on how many follow)."""
    times = arrivals(len(records), rate, seed)
    return Trace.of(
        attrs.evolve(record.trace, arrival=round(t, 6)) for record, t in zip(records, times)
    )


def derive(
    records: Sequence[ProblemRecord],
    config: BenchConfig,
    policy_for: PolicyFactory,
    grader: Grader,
    *,
    rate: float,
    on_run: Callable[[EvalRun], object] | None = None,
) -> list[EvalRun]:
    """Each (method, N) of ``config`` (``plan``) replayed on the simulator, graded.

    ``config`` is a simulated run (``engine="sim"``, ``trace`` set: the cost
    model, ``B``, scoring and PRM pricing come from it); ``policy_for(method, n)``
    builds each method's policy, whose ``extract`` must be ``unboxed``."""
    trace = replay_trace(records, rate, config.seed)
    by_id = {record.id: record for record in records}

    def grade(result: RequestResult) -> bool:
        record = by_id[result.request_id]
        known = record.correct_answer(result.answer)
        return known if known is not None else grade_answer(grader, result.answer, record.gold)

    runs = []
    for method, n in plan(config):
        record = run_method(trace, method, n, config, rate, policy=policy_for(method, n))
        run = EvalRun.graded(record, grade)
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return runs


__all__ = ["derive", "replay_trace", "unboxed"]
