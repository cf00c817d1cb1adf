"""A tiny trained reasoning model and PRM that run on a CPU: sart's real-engine testbed.

The task (``sart.testbed.tasks``) is a running sum mod 10 of a few digits,
answered by a step-by-step trace. A 0.9M-parameter Llama-architecture policy
trained on noisy traces reproduces what SART relies on: large length variance
between branches of one question, weakly related to correctness, a spread of
difficulty, and a process reward model (a token classifier in the format of
Qwen2.5-Math-PRM, loaded with ``sart.prm.hf.QwenMathPRM``; inside, the
policy's own likelihood of the trace read by a trained head, see
``modeling_testbed_prm``) that is informative but imperfect. The weights ship with the package under
``weights/``; ``sart testbed train`` reproduces them, ``sart testbed report``
measures their calibration. See ``docs/testbed.md``.

This module and ``tasks`` are pure Python; training, sampling and the report
need the ``[hf]`` extra.
"""

from __future__ import annotations

from pathlib import Path

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

WEIGHTS = Path(__file__).parent / "weights"
"""The shipped weights: ``policy/`` and ``prm/`` model directories, ``manifest.json``."""

POLICY_PATH = WEIGHTS / "policy"
PRM_PATH = WEIGHTS / "prm"
PRM_SEPARATOR = "<step>"
"""The PRM's step separator token (``QwenMathPRM(step_separator=...)``)."""
PRM_AGGREGATION = "last"
"""The step-reward aggregation the testbed PRM is meant for (see docs/testbed.md)."""


def prm_kwargs() -> dict[str, object]:
    """Keyword arguments for ``QwenMathPRM.from_pretrained(PRM_PATH, **prm_kwargs())``."""
    return {
        "system_prompt": None,
        "step_separator": PRM_SEPARATOR,
        "aggregate": PRM_AGGREGATION,
        "max_length": 512,
    }


__all__ = [
    "POLICY_PATH",
    "PRM_AGGREGATION",
    "PRM_PATH",
    "PRM_SEPARATOR",
    "WEIGHTS",
    "Question",
    "TraceConfig",
    "clean_trace",
    "grade",
    "make_question",
    "make_questions",
    "noisy_trace",
    "prm_kwargs",
    "step_labels",
]
