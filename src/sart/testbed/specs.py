"""The shipped testbeds by name: where their weights are and the settings they are calibrated for.

``--model testbed`` is the short testbed (traces of 20-150 tokens, checked every
16); ``--model testbed-long`` the long one (hundreds to thousands of tokens,
over-thinking and loops, checked every 64). Every command that takes a model
looks the name up here (``testbed(name)``), so a testbed's defaults are written
once.

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import attrs

from sart.testbed.tasks import Question, make_questions

HERE = Path(__file__).parent
PRM_SEPARATOR = "<step>"
"""The PRM's step separator token (``QwenMathPRM(step_separator=...)``)."""
PRM_AGGREGATION = "last"
"""The step-reward aggregation the testbed PRMs are meant for (see docs/testbed.md)."""


@attrs.frozen
class Testbed:
    """One shipped testbed: a policy, its PRM, its questions and its defaults."""

    name: str
    """The ``--model`` name that stands for it."""
    weights: Path
    """``policy/``, ``prm/`` and ``manifest.json``."""
    max_tokens: int
    """Tokens per branch by default: at least its longest rollout (a loop is cut here)."""
    interval: int
    """``T`` by default."""
    difficulties: tuple[int, ...]
    """Additions per question, cycled by its question sets (``questions``)."""
    prm_max_length: int
    """The PRM's input length: a prompt and a whole branch."""
    dataset_seed: int
    """Seed of its ``sart eval`` dataset (``--dataset NAME``), apart from the seeds its
    training and report draw from."""
    cycle: int | None = None
    """Its questions' most digits, added over rounds (``tasks.make_question``); ``None``:
    one digit per addition."""
    report_questions: int = 120
    """Questions in its calibration report (``sart testbed report``, seed 0)."""
    held_apart: bool = False
    """Its ``sart eval`` dataset leaves out the report's questions (``eval_questions``):
    a long question has only 4 digits, so two seeds' sets can share a few."""

    @property
    def policy_path(self) -> Path:
        return self.weights / "policy"

    @property
    def prm_path(self) -> Path:
        return self.weights / "prm"

    def prm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``QwenMathPRM.from_pretrained(prm_path, **prm_kwargs())``."""
        return {
            "system_prompt": None,
            "step_separator": PRM_SEPARATOR,
            "aggregate": PRM_AGGREGATION,
            "max_length": self.prm_max_length,
        }

    def questions(self, seed: int, count: int, exclude: Collection[str] = ()) -> list[Question]:
        """``count`` questions cycling through its difficulties, seeded (prompts in
        ``exclude`` drawn again: ``make_questions``)."""
        return make_questions(seed, count, self.difficulties, self.cycle, exclude)

    def eval_questions(self, count: int, seed: int = 0) -> list[Question]:
        """Its ``sart eval`` dataset's questions (``dataset_seed + seed``)."""
        held = self.questions(0, self.report_questions) if self.held_apart else []
        return self.questions(self.dataset_seed + seed, count, {q.prompt for q in held})


SHORT = Testbed(
    name="testbed",
    weights=HERE / "weights",
    max_tokens=256,
    interval=16,
    difficulties=(3, 4, 5, 6, 7, 8),
    prm_max_length=512,
    dataset_seed=0,
)
LONG = Testbed(
    name="testbed-long",
    weights=HERE / "weights-long",
    max_tokens=2048,
    interval=64,
    difficulties=(24, 32, 40, 48, 56, 64),
    cycle=4,
    prm_max_length=2304,
    dataset_seed=20_261_202,
    report_questions=200,
    held_apart=True,
)
TESTBEDS: dict[str, Testbed] = {t.name: t for t in (SHORT, LONG)}


def testbed(name: str | None) -> Testbed | None:
    """The testbed ``name`` stands for (``"testbed"``, ``"testbed-long"``), else None."""
    return TESTBEDS.get(name) if name is not None else None
