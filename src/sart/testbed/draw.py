"""Draw the testbed's branches and grade and score them: the data of ``sart testbed report``.

``draw`` samples ``n`` branches per question from the policy's seeded sampler
(``sart.testbed.model``), keeping each whole and cut to half its tokens;
``score_drawn`` grades them exactly and scores both cuts with a PRM's
``step_rewards``, giving one ``Branch`` each. Needs the ``[hf]`` extra to sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from sart.testbed.model import Sample
    from sart.testbed.tasks import Question


@attrs.frozen
class Branch:
    """One sampled branch, graded and scored."""

    question: int
    difficulty: int
    length: int
    """Generated tokens, EOS excluded."""
    answer: str
    correct: bool
    finished: bool
    half_rewards: tuple[float, ...]
    """PRM step rewards of the first half of the tokens."""
    full_rewards: tuple[float, ...]


@attrs.frozen
class Drawn:
    """One sampled branch before grading: its text whole and cut to half its tokens."""

    question_index: int
    question: Question
    sample: Sample
    half: str
    """The decoded first ``len(tokens) // 2`` tokens: the trace at 50%."""
    text: str


def draw(
    questions: Sequence[Question],
    n: int,
    policy: Any,
    tokenizer: Any,
    seed: int,
    max_new_tokens: int = 256,
    *,
    compact: bool = False,
) -> list[Drawn]:
    """``n`` branches per question from the seeded sampler, in order."""
    import torch

    from sart.testbed.model import sample

    prompts = [tokenizer(q.prompt)["input_ids"] for q in questions for _ in range(n)]
    samples = sample(
        policy,
        prompts,
        eos_id=tokenizer.eos_token_id,
        generator=torch.Generator().manual_seed(seed),
        max_new_tokens=max_new_tokens,
        compact=compact,
    )
    out = []
    for index, s in enumerate(samples):
        qi = index // n
        tokens = list(s.tokens)
        half = tokenizer.decode(tokens[: len(tokens) // 2], skip_special_tokens=True)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        out.append(Drawn(qi, questions[qi], s, half, text))
    return out


def score_drawn(prm: Any, drawn: Sequence[Drawn], n: int) -> list[Branch]:
    """Grade ``drawn`` (``n`` branches per question) and score each at 50% and
    100% of its tokens with ``prm`` (``step_rewards``)."""
    from sart.prm.base import ScoreItem
    from sart.testbed.tasks import grade
    from sart.types import BranchId

    items_half, items_full = [], []
    for index, d in enumerate(drawn):
        branch = BranchId(f"q{d.question_index}", index % n)
        length = len(d.sample.tokens)
        items_half.append(ScoreItem(branch, d.question.prompt, d.half, length // 2, False))
        items_full.append(ScoreItem(branch, d.question.prompt, d.text, length, True))
    half_rewards = prm.step_rewards(items_half)
    full_rewards = prm.step_rewards(items_full)
    return [
        Branch(
            question=d.question_index,
            difficulty=d.question.difficulty,
            length=len(d.sample.tokens),
            answer=_answer(d.text),
            correct=grade(d.question, d.text),
            finished=d.sample.finished,
            half_rewards=tuple(h),
            full_rewards=tuple(f),
        )
        for d, h, f in zip(drawn, half_rewards, full_rewards)
    ]


def _answer(text: str) -> str:
    from sart.answers import extract_answer

    return extract_answer(text)
