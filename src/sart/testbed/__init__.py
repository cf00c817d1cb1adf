"""Tiny trained reasoning models and PRMs that run on a CPU: sart's real-engine testbeds.

Two ship (``specs``): the short testbed (``--model testbed``) and the long one
(``--model testbed-long``: traces of hundreds to thousands of tokens, with
over-thinking and loops). The task (``sart.testbed.tasks``) is a running sum
mod 10 of a few digits (up to 64 for the long one), answered by a step-by-step
trace. A 0.9M-parameter Llama-architecture policy trained on noisy traces
reproduces what SART relies on: large length variance between branches of one
question, a spread of
difficulty, and a process reward model (a token classifier in the format of
Qwen2.5-Math-PRM, loaded with ``sart.prm.hf.QwenMathPRM``; inside, the
policy's own likelihood of the trace read by a trained head, see
``modeling_testbed_prm``) that is informative but imperfect. The weights ship
with the package under ``weights/`` and ``weights-long/``; ``sart testbed
train`` reproduces them, ``sart testbed report`` measures their calibration.
See ``docs/testbed.md``.

This module and ``tasks`` are pure Python; training, sampling and the report
need the ``[hf]`` extra.
"""

from __future__ import annotations

from sart.testbed.specs import (
    LONG,
    PRM_AGGREGATION,
    PRM_SEPARATOR,
    SHORT,
    TESTBEDS,
    Testbed,
    testbed,
)
from sart.testbed.tasks import (
    Question,
    TraceConfig,
    clean_trace,
    grade,
    make_question,
    make_questions,
    noisy_trace,
    step_labels,
)

WEIGHTS = SHORT.weights
"""The short testbed's weights: ``policy/`` and ``prm/`` model directories, ``manifest.json``."""

POLICY_PATH = SHORT.policy_path
PRM_PATH = SHORT.prm_path


def prm_kwargs() -> dict[str, object]:
    """Keyword arguments for ``QwenMathPRM.from_pretrained(PRM_PATH, **prm_kwargs())``
    (the short testbed's; ``Testbed.prm_kwargs`` for either)."""
    return SHORT.prm_kwargs()


__all__ = [
    "LONG",
    "POLICY_PATH",
    "PRM_AGGREGATION",
    "PRM_PATH",
    "PRM_SEPARATOR",
    "SHORT",
    "TESTBEDS",
    "WEIGHTS",
    "Question",
    "Testbed",
    "TraceConfig",
    "clean_trace",
    "grade",
    "make_question",
    "make_questions",
    "noisy_trace",
    "prm_kwargs",
    "step_labels",
    "testbed",
]
