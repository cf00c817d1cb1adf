"""``ConfidenceScorer``: confidence from the policy's own log-probabilities, as a reward source.

A PRM is a second model to serve; the policy's token distribution is free.
``ConfidenceScorer`` turns the log-probabilities engines report with each
token (``SamplingSettings.logprobs``, ``BranchDelta.logprobs``) into rewards
in [0, 1] behind the PRM's interface, so every prune rule and selector works
with it unchanged. The driver feeds it each decode call's deltas
(``observe``, from the loop's thread) and asks it for rewards at checks
(``score``, from a PRM worker thread when scoring overlaps): it is stateful
and locked, so it lives below the pure rules of
``sart.policies``. The signals and their rewards are in ``sart.confidence.signals``.

Memory: a branch keeps one running state (at most the signal's window of
floats); ``release`` drops a request's states.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import attrs

from sart.confidence.signals import NEUTRAL_REWARD, LowestGroupConfidence, Signal, Tracker
from sart.errors import PRMError, config_check, int_at_least
from sart.messages import ScoreItem, StepOutput
from sart.types import BranchId


def _check_signal(_inst: object, _attr: attrs.Attribute, value: object) -> None:
    config_check(isinstance(value, Signal), "signal", value, "a Signal")


def _check_scale(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    config_check(
        isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
        "scale",
        value,
        "a finite number > 0",
    )


@attrs.define(eq=False)
class ConfidenceScorer:
    """A reward source from the policy's own log-probabilities (see the module docstring).

    Give it to a policy (``Policy(reward=...)``, as the confidence recipes do)
    or to the driver in place of a PRM. The driver asks the engine for
    ``logprobs_wanted`` log-probabilities per token on every request it scores
    and feeds it each decode call's deltas. Its checks cost no model call.
    Rewards reflect every token decoded so far, which in overlapped scoring may
    be a few more than the check's snapshot saw.
    """

    signal: Signal = attrs.field(factory=LowestGroupConfidence, validator=_check_signal)
    top_k: int = attrs.field(default=20, validator=int_at_least(1))
    """Top log-probabilities per token (DeepConf uses 20); ignored by signals that read
    the sampled token's only."""
    scale: float = attrs.field(default=10.0, validator=_check_scale)
    """Confidence that maps to reward ``1 - 1/e``; see the module docstring."""
    _states: dict[str, dict[int, Tracker]] = attrs.field(factory=dict, init=False, repr=False)
    _errors: dict[BranchId, str] = attrs.field(factory=dict, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    @property
    def logprobs_wanted(self) -> int:
        """The ``SamplingSettings.logprobs`` this source needs."""
        return self.top_k if self.signal.needs_top else 0

    def observe(self, output: StepOutput) -> None:
        """Fold one decode call's tokens into the branches' states. Never raises: a
        branch whose tokens cannot be read fails its request at its next score."""
        with self._lock:
            for bid, delta in output.deltas.items():
                if not delta.logprobs or bid in self._errors:
                    continue
                branches = self._states.setdefault(bid.request_id, {})
                state = branches.get(bid.index)
                if state is None:
                    state = branches[bid.index] = self.signal.track()
                try:
                    for token in delta.logprobs:
                        # The engine may return more than this source asked for (a
                        # request that keeps its own logprobs asked for more):
                        # the signal reads its own top-k.
                        state.push(token.cut(self.top_k))
                except PRMError as exc:
                    self._errors[bid] = str(exc)

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        rewards = []
        with self._lock:
            for item in items:
                bid = item.branch
                if bid in self._errors:
                    raise PRMError(f"branch {bid}: {self._errors[bid]}", [bid.request_id])
                state = self._states.get(bid.request_id, {}).get(bid.index)
                if state is None or state.tokens == 0:
                    if item.num_tokens > 0:
                        raise PRMError(
                            f"branch {bid} made {item.num_tokens} tokens but the engine "
                            "reported no log-probabilities for them: does it support "
                            "SamplingSettings.logprobs?",
                            [bid.request_id],
                        )
                    rewards.append(NEUTRAL_REWARD)
                    continue
                rewards.append(self.signal.reward(state.value(), self.scale))
        return rewards

    def release(self, request_id: str) -> None:
        """Forget a finished request's branches."""
        with self._lock:
            branches = self._states.pop(request_id, {})
            for index in branches:
                self._errors.pop(BranchId(request_id, index), None)

    def state_size(self, branch: BranchId) -> int:
        """Floats held for one branch (0 if none): bounded by the signal's window."""
        state = self._states.get(branch.request_id, {}).get(branch.index)
        return 0 if state is None else state.size()

    @property
    def requests_held(self) -> int:
        """Requests with state held (0 once every request was released)."""
        return len(self._states)
