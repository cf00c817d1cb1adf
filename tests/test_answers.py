"""Answer extraction."""

from __future__ import annotations

import pytest

from sart import extract_answer


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so \\boxed{4}", "4"),
        ("\\boxed{1} then \\boxed{ 2 }", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("good \\boxed{7} then cut off \\boxed{8", "7"),
        ("line one\n\nThe answer is C\n\n", "The answer is C"),
        ("", ""),
        ("\n  \n", ""),
    ],
)
def test_extract_answer(text: str, answer: str) -> None:
    assert extract_answer(text) == answer
