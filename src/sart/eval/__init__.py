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
- ``sart.eval.mathverify``: math-verify bounded in time from any thread.

Importing ``sart.eval`` imports neither math-verify, sympy nor ``datasets``:
they load on first use (``pip install 'sart[eval]'``).
"""

from sart.eval.datasets import DATASETS, Dataset, Problem, load_dataset, load_jsonl
from sart.eval.equivalence import MathVerifyEquivalence
from sart.eval.grading import ChoiceGrader, ExactGrader, Grader, MathVerifyGrader, make_grader
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
    "load_dataset",
    "load_jsonl",
    "make_grader",
    "render_prompt",
]
