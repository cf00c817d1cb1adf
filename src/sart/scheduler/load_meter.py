"""``LoadMeter``: the measurements behind ``Load`` that the scheduler's tables do not
hold -- recent arrivals, the engine's last KV report, and what a decode step costs
(``StepCost``). The scheduler feeds it as things happen; ``view`` adds the counts."""

from __future__ import annotations

from collections import deque

from sart.scheduler.step_cost import StepCost
from sart.views import RATE_WINDOW, Load


class LoadMeter:
    """Arrival times, KV use and decode timings, for ``Load``."""

    def __init__(self) -> None:
        self._arrivals: deque[float] = deque(maxlen=RATE_WINDOW)  # for arrival_rate
        self._rate: float | None = None
        self._kv: tuple[int | None, int | None] = (None, None)
        self.steps = StepCost()
        """Decode timings: ``started`` when a ``Decode`` is emitted, ``finished``
        when it is answered."""

    def arrived(self, at: float) -> None:
        # The rate is computed here, not in ``view``: a view is taken for every
        # request's check, arrivals are far fewer.
        arrivals = self._arrivals
        arrivals.append(at)
        span = max(arrivals) - min(arrivals) if len(arrivals) >= 2 else 0.0
        self._rate = (len(arrivals) - 1) / span if span > 0 else None

    def observe(self, kv_tokens: int | None, kv_capacity: int | None) -> None:
        self._kv = (kv_tokens, kv_capacity)

    def view(
        self,
        *,
        waiting_requests: int,
        waiting_branches: int,
        running_branches: int,
        budget: int,
        active_requests: int,
        waited: float,
        prm_waiting: int,
    ) -> Load:
        """``Load`` from the scheduler's counts and these measurements."""
        fixed, per_row = self.steps.fit() or (None, None)
        return Load(
            waiting_requests=waiting_requests,
            waiting_branches=waiting_branches,
            running_branches=running_branches,
            budget=budget,
            active_requests=active_requests,
            arrival_rate=self._rate,
            waited=waited,
            prm_waiting=prm_waiting,
            kv_tokens=self._kv[0],
            kv_capacity=self._kv[1],
            step_fixed=fixed,
            step_per_row=per_row,
        )
