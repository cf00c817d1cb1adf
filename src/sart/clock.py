"""Clocks: the wall clock for real engines, a virtual clock for simulated ones."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Current time in the clock's unit (seconds for the wall clock)."""
        ...

    def sleep_until(self, t: float) -> None:
        """Wait (or jump, for a virtual clock) until ``now() >= t``."""
        ...


class WallClock:
    """Seconds since the clock was created, from ``time.monotonic``."""

    def __init__(self) -> None:
        self._origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._origin

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    """A clock that moves only when told: engines advance it by their modelled cost."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"dt={dt!r} must be >= 0")
        self._now += dt

    def sleep_until(self, t: float) -> None:
        self._now = max(self._now, float(t))
