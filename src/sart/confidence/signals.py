"""Confidence signals from the policy's own log-probabilities, and their rewards.

Each ``Signal`` makes a ``Tracker``: a branch's running state, fed the
log-probabilities the engine reports with each token, whose ``value`` the
signal maps to a reward in [0, 1]. ``ConfidenceScorer`` (``sart.confidence.scorer``)
holds one per branch behind the PRM's interface.

The signals (Fu et al., 2025, "Deep Think with Confidence", arXiv:2508.15260,
section 2, unless noted), with ``P_i(j)`` the ``j``-th most likely token's
probability at position ``i`` and ``k`` the top-k width:

- ``TokenConfidence``: the last token's ``C_i = -(1/k) sum_j log P_i(j)``. A
  peaked distribution puts little mass on the runners-up, so ``C_i`` is large
  when the model is sure.
- ``GroupConfidence(window)``: ``C_G = mean(C_i)`` over the last ``window``
  tokens (the sliding group).
- ``LowestGroupConfidence(window)``: the lowest ``C_G`` over every full
  window so far (the mean so far before the first window fills): DeepConf's
  online stopping signal. It never rises, so a branch that once lost its way
  stays low.
- ``TailConfidence(tail)``: ``mean(C_i)`` over the last ``tail`` tokens,
  DeepConf's score of a complete trace's ending.
- ``LowestTokenLogprob``: the lowest sampled-token log-probability so far
  (the signal the testbed's PRM ablation found separates right from wrong
  traces); ``MeanTokenLogprob``: their mean (minus the log-perplexity, as in
  Kadavath et al., 2022, and the "average log-probability" baselines).

Rewards: a log-probability signal ``L <= 0`` becomes ``exp(L)`` (a
probability: the lowest token's, or the geometric mean); a confidence
``C >= 0`` becomes ``1 - exp(-C / scale)``. Both maps are monotone, so a rule
that ranks branches or compares them with another branch's reward (SART's
phase 2, DeepConf's warm-up percentile) behaves the same whatever ``scale``;
only an absolute threshold (SART's phase-1 ``alpha``) depends on it.

Memory: a branch keeps one running state, at most ``window`` floats (a
``deque``), never its distributions.
DeepConf's "bottom 10% group confidence" needs every group of a trace, so it
is not offered.
"""

from __future__ import annotations

import abc
import math
from collections import deque
from collections.abc import Mapping

import attrs

from sart.errors import PRMError, int_at_least
from sart.messages import TokenLogprobs

#: Reward of a branch scored before it made a token (it cannot happen at a
#: check, which follows decoding; an empty completion can): neither pruned by
#: the paper's alpha nor preferred.
NEUTRAL_REWARD = 0.5


# ------------------------------------------------------------------ running states


class Tracker(abc.ABC):
    """One branch's running state of a signal (O(window) floats)."""

    tokens: int = 0

    @abc.abstractmethod
    def push(self, logprobs: TokenLogprobs) -> None:
        """Fold in one generated token."""

    @abc.abstractmethod
    def value(self) -> float:
        """The signal's raw value (only called once a token was pushed)."""

    def size(self) -> int:
        """Floats held (for the memory bound's test)."""
        return 0


def token_confidence(logprobs: TokenLogprobs) -> float:
    """DeepConf's ``C_i``: minus the mean of the top-k log-probabilities."""
    top = logprobs.top
    if not top:
        raise PRMError(
            "token confidence needs the top-k log-probabilities, but a token came with the "
            "sampled token's only (SamplingSettings.logprobs=0)"
        )
    return -math.fsum(top) / len(top)


class _Window(Tracker):
    """The mean of the last ``window`` values, and the lowest full-window mean seen."""

    __slots__ = ("_lowest", "_since_refresh", "_sum", "_values", "tokens")

    def __init__(self, window: int) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self._lowest = math.inf
        self.tokens = 0
        self._since_refresh = 0

    def push(self, logprobs: TokenLogprobs) -> None:
        self.add(token_confidence(logprobs))

    def add(self, x: float) -> None:
        values = self._values
        if len(values) == values.maxlen:
            self._sum -= values[0]
        values.append(x)
        self._sum += x
        self.tokens += 1
        self._since_refresh += 1
        if self._since_refresh >= len(values):  # keep the running sum from drifting
            self._sum = math.fsum(values)
            self._since_refresh = 0
        if len(values) == values.maxlen:
            self._lowest = min(self._lowest, self.mean())

    def mean(self) -> float:
        return self._sum / len(self._values)

    def lowest(self) -> float:
        return self._lowest if self._lowest != math.inf else self.mean()

    def value(self) -> float:
        return self.mean()

    def size(self) -> int:
        return len(self._values)


class _LowestWindow(_Window):
    __slots__ = ()

    def value(self) -> float:
        return self.lowest()


class _Logprobs(Tracker):
    __slots__ = ("_low", "_mean", "_sum", "tokens")

    def __init__(self, mean: bool) -> None:
        self._low = 0.0
        self._sum = 0.0
        self.tokens = 0
        self._mean = mean

    def push(self, logprobs: TokenLogprobs) -> None:
        self._low = min(self._low, logprobs.logprob)
        self._sum += logprobs.logprob
        self.tokens += 1

    def value(self) -> float:
        return self._sum / self.tokens if self._mean else self._low


# ------------------------------------------------------------------ signals


class Signal(abc.ABC):
    """What to compute from a branch's tokens, and how a value becomes a reward."""

    needs_top: bool = True
    """Whether it reads the top-k log-probabilities (else the sampled token's only)."""

    @abc.abstractmethod
    def track(self) -> Tracker:
        """A fresh running state for one branch."""

    def reward(self, value: float, scale: float) -> float:
        """A confidence ``C >= 0`` as ``1 - exp(-C / scale)`` (see the module docstring)."""
        return 1.0 - math.exp(-max(0.0, value) / scale)


@attrs.frozen
class TokenConfidence(Signal):
    """The last token's confidence ``C_i`` (a window of one)."""

    def track(self) -> Tracker:
        return _Window(1)


@attrs.frozen
class GroupConfidence(Signal):
    """Mean token confidence over the last ``window`` tokens."""

    window: int = attrs.field(default=2048, validator=int_at_least(1))

    def track(self) -> Tracker:
        return _Window(self.window)


@attrs.frozen
class LowestGroupConfidence(Signal):
    """The lowest group confidence over every full window so far (DeepConf-online's)."""

    window: int = attrs.field(default=2048, validator=int_at_least(1))

    def track(self) -> Tracker:
        return _LowestWindow(self.window)


@attrs.frozen
class TailConfidence(Signal):
    """Mean token confidence over the last ``tail`` tokens (DeepConf's tail score;
    the same running state as ``GroupConfidence``, named for how it is used: on
    complete branches)."""

    tail: int = attrs.field(default=2048, validator=int_at_least(1))

    def track(self) -> Tracker:
        return _Window(self.tail)


@attrs.frozen
class LowestTokenLogprob(Signal):
    """The lowest sampled-token log-probability so far; reward ``exp`` of it."""

    needs_top = False

    def track(self) -> Tracker:
        return _Logprobs(mean=False)

    def reward(self, value: float, scale: float) -> float:
        return math.exp(min(0.0, value))


@attrs.frozen
class MeanTokenLogprob(Signal):
    """The mean sampled-token log-probability; reward ``exp`` of it (1 / perplexity)."""

    needs_top = False

    def track(self) -> Tracker:
        return _Logprobs(mean=True)

    def reward(self, value: float, scale: float) -> float:
        return math.exp(min(0.0, value))


#: Signals by the names ``sart bench``/``sart serve`` take.
SIGNALS: Mapping[str, type[Signal]] = {
    "token": TokenConfidence,
    "group": GroupConfidence,
    "lowest-group": LowestGroupConfidence,
    "tail": TailConfidence,
    "lowest-logprob": LowestTokenLogprob,
    "mean-logprob": MeanTokenLogprob,
}


__all__ = [
    "NEUTRAL_REWARD",
    "SIGNALS",
    "GroupConfidence",
    "LowestGroupConfidence",
    "LowestTokenLogprob",
    "MeanTokenLogprob",
    "Signal",
    "TailConfidence",
    "TokenConfidence",
    "token_confidence",
]
