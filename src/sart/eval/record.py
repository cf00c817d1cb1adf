"""One recorded pass: every problem's ``n`` branches run to their end, scored every ``T``.

The pass serves the problems as ``sart bench --record-trace`` does
(``sart.bench.real.recording_policy``: no pruning, no early stop, every
running branch scored by the PRM every ``T`` tokens, blocking checks), all
queued at once and admitted as the branch budget ``B`` frees up. A branch's
answer is what the dataset's grader extracts from its text (the last
``\\boxed{}`` for math, the option letter for GPQA), and it is graded right
away (``grade_answer``). Each problem is handed to ``on_record`` as soon as
its last branch ends, so the caller can write it before the next one
finishes (``ProblemsFile.append``).

Every method's answer for every ``N`` up to ``n`` is in this pass: see
``sart.eval.derive``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from sart.bench.real import (
    LogprobRecorder,
    PromptItem,
    recording_driver,
    recording_policy,
    trace_request,
)
from sart.engines.base import Engine
from sart.eval.grading import Grader, grade_answer
from sart.eval.problems_file import ProblemRecord
from sart.prm.base import PRM
from sart.request import Request
from sart.results import RequestResult
from sart.types import SamplingSettings


@attrs.frozen
class Failure:
    """A problem whose recording failed (an engine or PRM error): not written, so that a
    later run records it again."""

    id: str
    reason: str


def record_problems(
    items: Sequence[PromptItem],
    engine: Engine,
    prm: PRM,
    grader: Grader,
    *,
    n: int,
    interval: int,
    sampling: SamplingSettings,
    batch_size: int,
    on_record: Callable[[ProblemRecord], object],
) -> list[Failure]:
    """Record ``items`` (``answer``: the gold one), calling ``on_record`` with each
    problem as it finishes; return the problems that failed. With
    ``sampling.logprobs`` set, each branch's log-probabilities are recorded too (per
    segment, as ``record_trace`` does), for the confidence methods' replay."""
    policy = recording_policy(n, interval, extract=grader.extract)
    by_id = {item.id: item for item in items}
    failures: list[Failure] = []

    def finished(result: RequestResult) -> None:
        item = by_id[result.request_id]
        if not result.ok:
            failures.append(Failure(item.id, result.reason or "failed"))
            return
        gold = item.answer or ""
        line = trace_request(
            item,
            result,
            engine,
            interval,
            arrival=0.0,
            logprobs=recorder,
            max_tokens=sampling.max_tokens,
        )
        grades: dict[str, bool] = {}  # a problem's branches often agree: grade each answer once
        correct = []
        for branch in line.branches:
            if branch.answer not in grades:
                grades[branch.answer] = grade_answer(grader, branch.answer, gold)
            correct.append(grades[branch.answer])
        on_record(ProblemRecord(item.id, gold, line, correct))

    # Every problem arrives at once: the pass is offline, only its tokens and
    # rewards are kept (the simulator gives each method its own latencies).
    requests = [Request(item.id, item.prompt, policy, sampling=sampling) for item in items]
    recorder = LogprobRecorder(engine) if sampling.logprobs is not None else None
    recording_driver(recorder or engine, prm, batch_size, on_result=finished).run(requests)
    return failures


__all__ = ["Failure", "record_problems"]
