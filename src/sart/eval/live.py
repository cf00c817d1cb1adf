"""``sart eval --live``: every method served for real, one after the other, graded.

Each (method, N) serves every problem on the loaded engine and PRM, arriving
as a Poisson process in real seconds, after a warm-up
(``sart.bench.real.run_real``, what ``sart bench --engine hf|vllm`` runs):
latencies are wall-clock, and each method pays for its own generation.
Answers are graded as the recorded pass grades them (``grade_answer`` on the
answer the dataset's grader extracts), so the two modes' accuracies estimate
the same thing; branch ``j`` of a problem has the same seed in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sart.bench.real import PolicyFactory, PromptItem, run_real
from sart.bench.runner import BenchConfig, RunRecord
from sart.engines.base import Engine
from sart.eval.accuracy import EvalRun
from sart.eval.grading import Grader, grade_answer
from sart.prm.base import PRM
from sart.results import RequestResult
from sart.types import SamplingSettings


def serve_live(
    items: Sequence[PromptItem],
    engine: Engine,
    prm: PRM | None,
    config: BenchConfig,
    sampling: SamplingSettings,
    policy_for: PolicyFactory,
    grader: Grader,
    on_run: Callable[[EvalRun], object] | None = None,
) -> list[EvalRun]:
    """Each (method, N) of ``config`` served on ``engine`` at ``config.rates[0]``, graded
    against the items' answers."""
    gold = {item.id: item.answer or "" for item in items}
    grades: dict[tuple[str, str | None], bool] = {}

    def grade(result: RequestResult) -> bool:
        key = (result.request_id, result.answer)
        if key not in grades:
            grades[key] = grade_answer(grader, result.answer, gold[result.request_id])
        return grades[key]

    runs: list[EvalRun] = []

    def finished(record: RunRecord) -> None:
        run = EvalRun.graded(record, grade)
        runs.append(run)
        if on_run is not None:
            on_run(run)

    run_real(items, engine, prm, config, sampling, on_run=finished, policy_for=policy_for)
    return runs


__all__ = ["serve_live"]
