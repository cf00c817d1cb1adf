"""What the core exchanges with engines and PRMs: plain data, no behaviour.

The scheduler's commands (``sart.commands``) carry these values to a driver,
which hands them to an engine or a PRM and brings their answers back:
``BranchSpec`` (a branch to start), ``StepOutput`` / ``BranchDelta`` (what a
decode call did), ``ScoreItem`` (a branch to score) and ``validate_reward``
(the one check of a PRM's answer). They live in the core, beside the
scheduler that reads them; the engine and PRM contracts
(``sart.engines.base``, ``sart.prm.base``) re-export them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import attrs

from sart.errors import PRMError
from sart.types import BranchId, FinishReason, Prompt


@attrs.frozen
class BranchSpec:
    """A branch to start: its index within the request and its sampling seed."""

    index: int
    seed: int
    parent: int | None = None
    """Fork: start from this live branch's current state (its generated tokens
    and their KV) instead of from the bare prefix. Only engines with
    ``supports_fork = True`` accept it."""
    resume: bool = False
    """Resume this branch, paused earlier (``pause``), from its generated tokens: the
    engine recomputes their KV (its prefix cache serves the prompt) and the branch
    goes on from there. Only engines with ``supports_pause = True`` accept it."""


class TokenLogprobs(NamedTuple):
    """The log-probabilities reported with one generated token (natural log)."""

    logprob: float
    """The sampled token's."""
    top: tuple[float, ...] = ()
    """The ``k`` most likely tokens', highest first (``k`` = ``SamplingSettings.logprobs``;
    empty for ``logprobs=0``; fewer than ``k`` where a server keys them by token text
    and two tokens share one, see ``sart.engines.openai``)."""
    token_id: int | None = None
    """The sampled token's id (``None``: an engine that does not say)."""
    top_ids: tuple[int, ...] = ()
    """The ids of ``top``'s tokens, in its order (empty: an engine that does not say).
    Confidence signals read only the values; a server answering a request's
    ``logprobs`` needs the ids to say which tokens they are (``Request.keep_logprobs``)."""

    def cut(self, k: int) -> TokenLogprobs:
        """These with only the ``k`` most likely tokens (itself where it has no more)."""
        if len(self.top) <= k:
            return self
        return self._replace(top=self.top[:k], top_ids=self.top_ids[:k])


@attrs.frozen
class BranchDelta:
    """What one branch did during one ``step`` call."""

    new_tokens: int
    """Tokens generated in this call."""
    text: str
    """Their text."""
    finish: FinishReason | None = None
    """Set if the branch ended in this call (its KV is then already freed)."""
    end_offset: int | None = None
    """1-based step within this call at which it ended."""
    token_ids: tuple[int, ...] = ()
    """The new tokens' ids, for engines that have them (empty otherwise)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per new token, in order, when the request's ``SamplingSettings.logprobs``
    is set (empty otherwise)."""
    stop_reason: str | int | None = None
    """With ``finish`` ``STOP``: what stopped the branch, as vLLM's ``stop_reason`` says
    it (the stop string that matched, the id of the stop token; ``None`` for EOS, or
    where the engine cannot tell)."""


@attrs.frozen
class StepOutput:
    """Result of one ``step`` call."""

    steps: int
    """Decode steps actually run (fewer than asked if the call ended early)."""
    deltas: Mapping[BranchId, BranchDelta]
    """Per live branch; a branch that made no progress may be absent."""
    request_steps: Mapping[str, int] | None = None
    """Steps each request advanced, when requests advance independently (a streaming
    engine with ``per_request_steps``: lockstep within a request, not across them);
    a request with live branches that is absent advanced none, and ``steps`` is the
    largest. ``None``: every request advanced ``steps``."""


@attrs.frozen
class ScoreItem:
    """One branch to score."""

    branch: BranchId
    prompt: Prompt
    text: str
    """The branch's response so far."""
    num_tokens: int
    """Tokens generated so far (lets a PRM or a script key on progress)."""
    final: bool
    """True when the branch has completed (this is its final score)."""


def validate_reward(value: object, branch: BranchId) -> float:
    """Return ``value`` as a float in [0, 1], or raise ``PRMError`` naming the branch."""
    try:
        if isinstance(value, (str, bytes)):  # float("0.5") would take it
            raise TypeError
        reward = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise PRMError(
            f"PRM returned {value!r} for branch {branch}, not a number", [branch.request_id]
        ) from None
    if math.isnan(reward) or not 0.0 <= reward <= 1.0:
        raise PRMError(
            f"PRM returned reward {reward!r} for branch {branch}; rewards must be in [0, 1]",
            [branch.request_id],
        )
    return reward
