"""What a training run watches (``sart.testbed.train`` logs it every 100 steps): how
often the policy's most likely token is right, teacher-forced on clean traces, after a
position token (``copy``), after ``=`` (``add``) and at a step's count of rounds left
(``count``), on fixed probe questions of a few lengths."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import torch

from sart.testbed.recipe import TrainConfig, hardest
from sart.testbed.tasks import Question, clean_trace, make_question

_POSITION = re.compile(r"^p\d+$")
_ROUND = re.compile(r"^r\d+$")


def skill_probes(config: TrainConfig, count: int = 16) -> list[list[Question]]:
    """Fixed questions (their own seed, not the training stream's) on which ``skills``
    watches a training run: a group at the hardest difficulty of its first step,
    one at ``grown_min_digits`` if set, and one at ``max_digits`` if that is harder
    (a curriculum's goal). A skill can be learned at one length and not another: a
    cycled run copied position 6 only in questions of 8 rounds."""
    rng = random.Random(f"skills-{config.seed}")
    levels = sorted(
        {hardest(config, 0), config.max_digits}
        | ({config.grown_min_digits} if config.grown_min_digits else set())
    )
    return [[make_question(rng, level, config.cycle) for _ in range(count)] for level in levels]


@torch.no_grad()
def skills(model: Any, tokenizer: Any, questions: Sequence[Question]) -> tuple[float, float]:
    """Teacher-forced accuracy of the two skills the task needs, on clean traces.

    ``copy``: after a step's position token ``pK``, the argmax is the prompt's
    digit K. ``add``: after ``=``, it is the step's sum. A run that has learned the
    format but not the sums shows a low ``add`` long before sampled rollouts do.
    No RNG is drawn and no gradient kept: watching does not change the run.
    """
    hits = skill_hits(model, tokenizer, questions)
    return hits["copy"], hits["add"]


def skill_hits(model: Any, tokenizer: Any, questions: Sequence[Question]) -> dict[str, float]:
    """``skills``, and for cycled questions ``count``: the argmax at a step's start is
    its count of rounds left (the previous step's, one less after a round's last)."""
    from sart.testbed.train import encode_example  # train imports this module

    hits = {"copy": [0, 0], "add": [0, 0], "count": [0, 0]}
    for question in questions:
        ids, n_prompt = encode_example(tokenizer, question.prompt, clean_trace(question))
        words = tokenizer.convert_ids_to_tokens(ids)
        predicted = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist()
        # From the prompt's last token: it predicts the first step's count.
        for i in range(n_prompt - 1, len(ids) - 1):
            kind = "add" if words[i] == "=" else "copy" if _POSITION.match(words[i]) else None
            if _ROUND.match(words[i + 1]):
                kind = "count"
            if kind is not None:
                hits[kind][0] += predicted[i] == ids[i + 1]
                hits[kind][1] += 1
    return {k: h / max(1, n) for k, (h, n) in hits.items() if k != "count" or n}
