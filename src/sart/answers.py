"""Answer extraction: turn a branch's text into the answer that votes and grading compare."""

from __future__ import annotations

_BOXED = "\\boxed{"


def extract_answer(text: str) -> str:
    """The content of the last ``\\boxed{...}`` (braces balanced), else the last
    non-empty line, stripped. Returns ``""`` for empty text.

    >>> extract_answer("so x = 2.\\n\\\\boxed{\\\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    >>> extract_answer("reasoning\\nThe answer is B\\n")
    'The answer is B'
    """
    start = text.rfind(_BOXED)
    while start != -1:
        inner = _balanced(text, start + len(_BOXED))
        if inner is not None:
            return inner.strip()
        # An unclosed \boxed{ (e.g. a truncated branch): try the previous one.
        start = text.rfind(_BOXED, 0, start)
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def _balanced(text: str, pos: int) -> str | None:
    depth = 1
    for i in range(pos, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[pos:i]
    return None
