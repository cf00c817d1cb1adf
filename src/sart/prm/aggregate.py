"""Steps and step rewards: split a response into steps, turn per-step rewards into one.

A process reward model rates each reasoning *step*; SART needs one number per
branch. ``split_steps`` cuts a response on blank lines (``"\\n\\n"``, the step
convention of Qwen2.5-Math-PRM and of most math reasoning models), and
``aggregate`` reduces the step rewards with one of:

- ``last``: the reward of the last step;
- ``min``: the lowest step reward (the default);
- ``prod``: the product of the step rewards;
- ``mean``: their average.

Why ``min`` by default. A chain of reasoning is only as sound as its weakest
step: one wrong step usually makes the final answer wrong, and ``min`` is the
only aggregate that a single bad step can pull down all the way whatever the
number of good steps around it (``mean`` dilutes it). Among the aggregates
that share this property, ``prod`` also falls with the *number* of steps, so
two equally sound branches get different rewards when one writes shorter
steps, and an absolute pruning threshold (SART prunes below ``alpha = 0.5``
in its first phase) ends up pruning long branches just for being long; ``min``
stays on the scale of a step reward whatever the length. ``last`` reads one
step only, and during generation the last step is cut mid-sentence every
``T`` tokens, so it is the noisiest reading; it fits PRMs trained to predict
the outcome from a prefix (Monte-Carlo value labels), less so step verifiers
such as Qwen2.5-Math-PRM, whose labels mark the first wrong step. ``min`` is
also how Math-Shepherd scores a whole solution. The cost of ``min`` is
that one noisy low step is enough to prune a branch; choose ``mean`` where
the PRM is known to be noisy.

A response with no step yet (empty or blank) has no step reward; its reward is
``NO_STEPS_REWARD = 0.5``, neutral: not below the paper's ``alpha``.
``check_finite`` refuses step rewards that are NaN or infinite, naming the
requests concerned. Pure Python, like the rest of this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sart.errors import ConfigError, PRMError

if TYPE_CHECKING:
    from sart.prm.base import ScoreItem

STEP_SEPARATOR = "\n\n"
"""Steps are the pieces of a response between blank lines."""

NO_STEPS_REWARD = 0.5
"""The reward of a response with no step: neutral (not below SART's ``alpha = 0.5``)."""

DEFAULT_AGGREGATION = "min"


def _last(rewards: Sequence[float]) -> float:
    return rewards[-1]


def _mean(rewards: Sequence[float]) -> float:
    return math.fsum(rewards) / len(rewards)


AGGREGATIONS: dict[str, Callable[[Sequence[float]], float]] = {
    "last": _last,
    "min": min,
    "prod": math.prod,
    "mean": _mean,
}


def check_aggregation(how: str) -> str:
    """Return ``how`` if it names an aggregation, else raise ``ConfigError`` listing them."""
    if how not in AGGREGATIONS:
        raise ConfigError(f"aggregate={how!r} must be one of {sorted(AGGREGATIONS)}")
    return how


def aggregate(rewards: Sequence[float], how: str = DEFAULT_AGGREGATION) -> float:
    """One reward from the per-step ``rewards`` (``last``, ``min``, ``prod`` or ``mean``).

    No step rewards give ``NO_STEPS_REWARD``. The result is a float; for
    rewards in [0, 1] it is in [0, 1].
    """
    reduce = AGGREGATIONS[check_aggregation(how)]
    if len(rewards) == 0:
        return NO_STEPS_REWARD
    return float(reduce(rewards))


def split_steps(text: str) -> list[str]:
    """The steps of a response: its pieces between ``"\\n\\n"``, blank pieces dropped.

    The last piece is kept even when it is incomplete (the response is still
    being generated). Pieces are not stripped, so that the steps are exactly
    the text the policy wrote; only pieces with nothing but whitespace (from
    runs of blank lines) are dropped. Splitting is stable as the text grows:
    every step but the last keeps its text when more text is appended, which
    is what lets ``sart.prm.hf`` cache the PRM's work on complete steps.
    """
    return [piece for piece in text.split(STEP_SEPARATOR) if piece.strip()]


def check_finite(items: Sequence[ScoreItem], results: Sequence[Sequence[float]]) -> None:
    """Raise ``PRMError`` naming the requests whose step rewards are not all finite
    (``results[i]`` are the step rewards of ``items[i]``)."""
    bad = [item.branch for item, r in zip(items, results) if not all(map(math.isfinite, r))]
    if bad:
        raise PRMError(
            f"PRM gave non-finite step rewards for branch {', '.join(map(str, bad))}",
            {b.request_id for b in bad},
        )
