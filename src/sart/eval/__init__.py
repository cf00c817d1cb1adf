"""Evaluation on benchmarks: datasets, prompt templates, grading, votes by meaning.

- ``sart.eval.datasets``: ``Problem``, ``Dataset``, the stock datasets
  (MATH-500, AIME 2024/2025, GPQA-Diamond, a user's JSONL) from local files
  or the Hugging Face hub;
- ``sart.eval.prompts``: ``PromptTemplate``, DeepSeek-R1's directive,
  ``render_prompt`` (plain, or through a chat template);
- ``sart.eval.grading``: the ``Grader`` interface, ``MathVerifyGrader``,
  ``ChoiceGrader``, ``ExactGrader``, ``make_grader``;
- ``sart.eval.equivalence``: ``MathVerifyEquivalence``, for the votes'
  ``equivalence``;
- ``sart.eval.mathverify``: math-verify bounded in time from any thread;
- ``sart eval`` (``sart.eval.command``): one recorded pass (``record``, written to
  ``problems_file`` as it goes), every method at every ``N`` derived from it on the
  simulator (``derive``) or served for real (``live``), graded with 95% intervals
  (``accuracy``), reported (``report``, ``plots``). Those modules import the
  simulator and the drivers, so they are not imported here.

Importing ``sart.eval`` imports neither math-verify, sympy nor ``datasets``:
they load on first use (``pip install -e '.[eval]'``).
"""

from sart.eval.datasets import (
    DATASETS,
    Dataset,
    Problem,
    load_dataset,
    load_jsonl,
    load_testbed,
)
from sart.eval.equivalence import MathVerifyEquivalence
from sart.eval.grading import (
    ChoiceGrader,
    ExactGrader,
    Grader,
    MathVerifyGrader,
    grade_answer,
    make_grader,
)
from sart.eval.prompts import PromptTemplate, render_prompt

__all__ = [
    "DATASETS",
    "ChoiceGrader",
    "Dataset",
    "ExactGrader",
    "Grader",
    "MathVerifyEquivalence",
    "MathVerifyGrader",
    "Problem",
    "PromptTemplate",
    "grade_answer",
    "load_dataset",
    "load_jsonl",
    "load_testbed",
    "make_grader",
    "render_prompt",
]
