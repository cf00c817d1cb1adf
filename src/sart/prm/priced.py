"""``CostedPRM``: any PRM plus a model of how long its calls take, for virtual clocks.

The simulator and the fake engine keep virtual time; a PRM that answers at
once (``ScriptedPRM``) would make every check free. Wrapping it with a cost
function (``sart.engines.costs`` has models of real PRMs) makes it a
``PricedPRM``: the driver lets each call take ``cost(items)`` seconds of
virtual time, blocking decoding or overlapping with it (``sart.Scoring``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sart.errors import ConfigError
from sart.prm.base import PRM, ScoreItem


class CostedPRM:
    """``prm``'s rewards, ``cost(items)``'s seconds per call.

    ``shares_engine``: the PRM runs on the policy's accelerator, so a call
    holds decoding up for its whole cost even when checks are overlapped.
    ``replicas``: copies of the PRM, each serving one call at a time, so that
    overlapped calls run side by side (the driver keeps as many in flight:
    ``workers``).
    """

    def __init__(
        self,
        prm: PRM,
        cost: Callable[[Sequence[ScoreItem]], float],
        *,
        shares_engine: bool = False,
        replicas: int = 1,
    ) -> None:
        if not (isinstance(replicas, int) and replicas >= 1):
            raise ConfigError(f"replicas={replicas!r} must be an int >= 1")
        self.prm = prm
        self._cost = cost
        self.shares_engine = shares_engine
        self.replicas = replicas

    @property
    def workers(self) -> int:
        """Calls the driver keeps in flight by default: one per replica."""
        return self.replicas

    def score(self, items: Sequence[ScoreItem]) -> Sequence[float]:
        return self.prm.score(items)

    def cost(self, items: Sequence[ScoreItem]) -> float:
        seconds = float(self._cost(items))
        if not seconds >= 0.0:  # also refuses NaN
            raise ValueError(f"PRM cost model returned {seconds!r} seconds; must be >= 0")
        return seconds

    def release(self, request_id: str) -> None:
        release = getattr(self.prm, "release", None)
        if release is not None:
            release(request_id)
        forget = getattr(self._cost, "release", None)
        if forget is not None:
            forget(request_id)
