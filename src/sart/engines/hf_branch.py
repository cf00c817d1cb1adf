"""A request's prompt and a branch as the transformers engine (``sart.engines.hf``) holds them.

``PromptKV`` is what a request's prefill leaves: the prompt's KV (never written), the
next-token logits after it, and its ids. A ``Branch`` is a live (or paused) branch:
where its KV is (a ``Span``, ``sart.engines.hf_kv``), its tokens and the text reported
so far, its seed, and its next-token logits, kept as a row of the step's logits until
read, so that a step does no tensor work per branch.
"""

from __future__ import annotations

import attrs
import torch

from sart.engines.detok import Detok
from sart.engines.hf_kv import KV, Span
from sart.engines.ledger import Prefix


@attrs.frozen(eq=False)
class PromptKV:
    """A prefix's data: the prompt's KV (never written), the next-token logits after it,
    and its ids (``repetition_penalty`` reads them)."""

    kv: KV
    logits: torch.Tensor
    ids: tuple[int, ...] = ()


_START = Detok()


class Branch:
    """A branch of the transformers engine (the module docstring)."""

    __slots__ = ("_logits", "_row", "detok", "prefix", "seed", "span", "text", "tokens")

    def __init__(
        self,
        prefix: Prefix[PromptKV],
        span: Span | None,
        logits: torch.Tensor,
        tokens: list[int],
        text: str,
        seed: int,
        detok: Detok = _START,
    ) -> None:
        self.prefix = prefix
        self.span = span  # where its KV is (sart.engines.hf_kv); None while paused
        self._logits = logits  # its next-token logits (``logits``), or a step's
        self._row: int | None = None  # ... row of them
        self.tokens = tokens
        self.text = text  # reported so far
        self.seed = seed  # its draws: sart.engines.hf_sampling.uniforms(seed, draw)
        self.detok = detok  # where decoding its tokens to text stands

    @property
    def logits(self) -> torch.Tensor:
        """Its next-token logits (a row of a step's, taken only when read)."""
        return self._logits if self._row is None else self._logits[self._row]

    @logits.setter
    def logits(self, logits: torch.Tensor) -> None:
        self._logits, self._row = logits, None

    def logits_in(self, step: torch.Tensor, row: int) -> None:
        """Its next-token logits are ``step``'s row ``row`` (no tensor op per branch)."""
        self._logits, self._row = step, row

    @property
    def own(self) -> int:
        """Tokens in this branch's own KV (generated and already forwarded)."""
        return self.span.length - self.prefix.tokens if self.span is not None else 0

    @property
    def length(self) -> int:
        """Tokens in this branch's KV (prefix + its own)."""
        return self.prefix.tokens + self.own


__all__ = ["Branch", "PromptKV"]
