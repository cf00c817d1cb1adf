"""Incremental detokenization: a growing token list's text, decoding only its tail.

Decoding a branch's whole output every step costs ``O(L)`` per token, ``O(L^2)``
per branch: on the long testbed (2,048-token branches) it was a tenth of a
decode step. As vLLM's detokenizer does, ``Detok`` keeps the text of the tokens
up to ``read`` (ending at a whole character) and decodes only a window from
``prefix`` (the previous chunk, for context: a tokenizer may decode a token
differently at the start of a string, such as a leading space) to the end, less
the window's own prefix text. A chunk ending in a partial character
(``\\ufffd``, a multi-byte character cut between tokens) is not committed: the
window grows until it resolves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

Decode = Callable[[Sequence[int]], str]


@attrs.frozen
class Detok:
    """Where incremental decoding stands (a value: a fork copies it by sharing it)."""

    stable: str = ""
    """The text of the tokens before ``read``."""
    prefix: int = 0
    """Where the decoded window starts."""
    read: int = 0
    """Tokens whose text is in ``stable``."""
    prefix_text: str = ""
    """The text of ``tokens[prefix:read]`` decoded alone: subtracted from the window's."""

    def text(self, decode: Decode, tokens: Sequence[int], count: int) -> tuple[str, Detok]:
        """The text of ``tokens[:count]``, and the state for the next call (``count``
        only grows between calls; ``tokens[:read]`` never changes)."""
        window = decode(tokens[self.prefix : count])
        tail = window[len(self.prefix_text) :]
        text = self.stable + tail
        if count == self.read or not tail or tail.endswith("\ufffd"):
            return text, self
        return text, Detok(text, self.read, count, decode(tokens[self.read : count]))


__all__ = ["Decode", "Detok"]
