"""Prompt templates: how a benchmark problem becomes the text a model reads.

A ``PromptTemplate`` is data: a text with a ``{problem}`` placeholder (and
``{choices}`` for multiple choice, rendered ``A) ...`` one per line), plus an
optional system message used only with a chat template. The math datasets
use DeepSeek-R1's recommendation (``R1_INSTRUCTION`` after the problem, no
system prompt); GPQA lists the lettered options and asks for the letter in
``\\boxed{}``.

``render_prompt`` renders a problem as plain text or, given a tokenizer,
through its chat template (``apply_chat_template(..., add_generation_prompt=True,
tokenize=False)``). Use one or the other: an engine opened with
``chat=True`` applies the chat template itself, so give it the plain text.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import attrs

from sart.errors import ConfigError

if TYPE_CHECKING:
    from sart.eval.datasets import Problem

R1_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""DeepSeek-R1's recommended directive for mathematical problems."""

LETTERS = "ABCD"
"""Option letters of multiple-choice problems, in order."""

_PLACEHOLDER = re.compile(r"\{(problem|choices)\}")


def _check_text(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or "{problem}" not in value:
        raise ConfigError(f"template={value!r} must be a string with a {{problem}} placeholder")


@attrs.frozen
class PromptTemplate:
    """A prompt: ``text`` with ``{problem}`` and optionally ``{choices}`` placeholders."""

    text: str = attrs.field(validator=_check_text)
    """The user message. Only the two placeholders are substituted; any other
    brace (``\\boxed{}``) is kept as written."""
    system: str | None = None
    """A system message, used only when rendering through a chat template."""

    def render(self, problem: Problem) -> str:
        """The user message for ``problem``."""

        def fill(match: re.Match[str]) -> str:
            if match.group(1) == "problem":
                return problem.problem
            return format_choices(problem)

        return _PLACEHOLDER.sub(fill, self.text)


def format_choices(problem: Problem) -> str:
    """``problem.fields["choices"]`` as ``A) ...`` lines."""
    choices = problem.fields.get("choices")
    if not isinstance(choices, (list, tuple)) or not 2 <= len(choices) <= len(LETTERS):
        raise ConfigError(
            f"problem {problem.id!r}: the template lists {{choices}}, but its fields have "
            f"choices={choices!r} (2 to {len(LETTERS)} options expected)"
        )
    return "\n".join(f"{letter}) {choice}" for letter, choice in zip(LETTERS, choices))


MATH = PromptTemplate("{problem}\n\n" + R1_INSTRUCTION)
"""The math datasets' template (MATH-500, AIME, user JSONL): DeepSeek-R1's directive."""

MULTIPLE_CHOICE = PromptTemplate(
    "{problem}\n\n{choices}\n\nPlease reason step by step, and put the letter of the "
    "correct option (A, B, C or D) within \\boxed{}."
)
"""GPQA's template: the question, its lettered options, the letter in ``\\boxed{}``."""


def render_prompt(problem: Problem, template: PromptTemplate, tokenizer: Any = None) -> str:
    """``problem`` as ``template`` words it; through ``tokenizer``'s chat template when
    given (one user message after the template's system message, if any, and the
    generation prompt), else the plain text."""
    text = template.render(problem)
    if tokenizer is None:
        return text
    messages = [{"role": "system", "content": template.system}] if template.system else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


__all__ = [
    "LETTERS",
    "MATH",
    "MULTIPLE_CHOICE",
    "R1_INSTRUCTION",
    "PromptTemplate",
    "format_choices",
    "render_prompt",
]
