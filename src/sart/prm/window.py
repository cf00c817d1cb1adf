"""The PRM's context window: which tokens of a (question, steps) input a PRM sees.

Pure Python on token ids; shared by every PRM backend (``sart.prm.hf``,
``sart.prm.vllm``) through ``sart.prm.formats``.

An input is ``Encoded``: a prefix (system prompt and question) then one
segment per step, each holding the token that rates it. ``ContextLimit`` says
how long inputs may be, and ``fit_context`` cuts one to fit:

- ``max_length`` tokens of context (4096 for Qwen2.5-Math-PRM-7B); inputs are
  never longer. ``overflow="window"`` (the default) keeps the prefix and the
  most recent steps that fit, dropping the earliest steps: their rewards are
  then not part of the aggregate, since the model did not see them. If even
  the last step does not fit, its most recent tokens are kept (its rating
  token included). If the prefix alone would leave the steps less than
  ``min(their length, max_length // 2)`` tokens, the prefix is cut from the
  left. ``overflow="error"`` raises ``ContextOverflow`` instead (the backends
  turn it into ``PRMError`` for the request).
- ``window_stride = S > 1`` makes the window's start move in jumps of ``S``
  tokens instead of step by step: the window then holds between ``B - S``
  and ``B`` tokens of steps (``B`` the room left by the prefix), but an
  incremental PRM keeps its cache between jumps.
- ``window = W`` bounds every input whatever the context: the prefix and the
  most recent steps within ``W`` response tokens, cut as above (same stride),
  so that re-scoring a long branch costs ``O(prefix + W)`` tokens per check
  instead of ``O(L)``. Unlike a smaller ``max_length``, it does not depend on
  the question's length and never cuts the question. Steps before the window
  are not rated, and the kept ones are rated without the earlier ones in
  view: what that costs in reward quality depends on the PRM
  (``benchmarks/prm_window.py`` measures it on the testbed).

The cut is deterministic in the input, so full and incremental scoring see
the same window.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import attrs

from sart.errors import config_check, int_at_least

OVERFLOW_MODES = ("window", "error")

__all__ = ["OVERFLOW_MODES", "ContextLimit", "ContextOverflow", "Encoded", "fit_context"]


@attrs.frozen
class Encoded:
    """One PRM input: ``prefix`` then one segment per step.

    ``rating[i]`` is the index, inside ``segments[i]``, of the token whose
    logits rate step ``i`` (the separator or tag after it). ``first_step`` is
    the index among the response's steps of ``segments[0]`` (not 0 when the
    window dropped early steps).
    """

    prefix: tuple[int, ...]
    segments: tuple[tuple[int, ...], ...]
    rating: tuple[int, ...]
    first_step: int = 0

    def __len__(self) -> int:
        return len(self.prefix) + sum(map(len, self.segments))

    def ids(self) -> list[int]:
        return list(itertools.chain(self.prefix, *self.segments))

    def positions(self) -> list[int]:
        """Positions in ``ids()`` of the rating tokens, one per step."""
        out, start = [], len(self.prefix)
        for segment, at in zip(self.segments, self.rating):
            out.append(start + at)
            start += len(segment)
        return out


@attrs.frozen
class ContextLimit:
    """How inputs longer than the PRM's context are handled (see the module docstring)."""

    max_length: int = attrs.field(default=4096, validator=int_at_least(16))
    """Tokens of context: no input is longer."""
    overflow: str = attrs.field(default="window")
    """``"window"``: keep the prefix and the latest steps; ``"error"``: refuse the input."""
    window_stride: int = attrs.field(default=1, validator=int_at_least(1))
    """The window's start moves in jumps of this many tokens."""
    window: int | None = attrs.field(
        default=None,
        validator=int_at_least(1, optional=True, rule="None or an int >= 1 (response tokens)"),
    )
    """Response tokens kept in every input (``None``: as many as ``max_length`` allows)."""

    @overflow.validator
    def _check_overflow(self, _attr: attrs.Attribute, value: str) -> None:
        config_check(value in OVERFLOW_MODES, "overflow", value, f"one of {OVERFLOW_MODES}")


class ContextOverflow(Exception):
    """An input is longer than ``max_length`` and ``overflow="error"``."""


def fit_context(enc: Encoded, limit: ContextLimit) -> Encoded:
    """``enc`` cut to at most ``limit.window`` response tokens, then to at most
    ``limit.max_length`` tokens (see the module docstring).

    Deterministic in ``enc``: full and incremental scoring see the same window.
    """
    if limit.window is not None and len(enc) - len(enc.prefix) > limit.window:
        enc = _recent_steps(enc, enc.prefix, limit.window, limit.window_stride)
    if len(enc) <= limit.max_length:
        return enc
    if limit.overflow == "error":
        raise ContextOverflow(f"{len(enc)} tokens, over max_length={limit.max_length}")
    steps_length = len(enc) - len(enc.prefix)
    # The steps get at least min(their length, half the context); a longer
    # prefix (a huge question) loses its beginning.
    room = limit.max_length - min(steps_length, limit.max_length // 2)
    prefix = enc.prefix[-room:] if len(enc.prefix) > room else enc.prefix
    return _recent_steps(enc, prefix, limit.max_length - len(prefix), limit.window_stride)


def _recent_steps(enc: Encoded, prefix: tuple[int, ...], budget: int, stride: int) -> Encoded:
    """``prefix`` and the most recent steps of ``enc`` within ``budget`` tokens."""
    first = _first_kept(enc.segments, budget, stride)
    segments, rating = enc.segments[first:], enc.rating[first:]
    if sum(map(len, segments)) > budget:  # only the last step is left, and it is too long
        segments, rating = _keep_end(segments[-1], rating[-1], budget)
    return Encoded(prefix, segments, rating, enc.first_step + first)


def _keep_end(
    segment: tuple[int, ...], at: int, budget: int
) -> tuple[tuple[tuple[int, ...]], tuple[int]]:
    """The most recent ``budget`` tokens of a segment that keep its rating token
    ``at``; tokens after that one do not change its logits and go first."""
    excess = len(segment) - budget
    if at >= excess:
        return (segment[excess:],), (at - excess,)
    start = max(0, at + 1 - budget)
    return (segment[start : at + 1],), (at - start,)


def _first_kept(segments: Sequence[Sequence[int]], budget: int, stride: int) -> int:
    """Index of the first segment of the window: the first one starting at or
    after the smallest multiple of ``stride`` that leaves at most ``budget``
    tokens; the last segment if none does."""
    starts = list(itertools.accumulate(map(len, segments), initial=0))
    excess = starts[-1] - budget
    if excess <= 0:
        return 0
    offset = -(-excess // stride) * stride  # ceil to a multiple of stride
    return min(bisect.bisect_left(starts, offset), len(segments) - 1)
