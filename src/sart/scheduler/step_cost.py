"""``StepCost``: what a decode step costs on this engine, fitted from the steps it ran.

A decode step's time is modelled as ``fixed + per_row x rows``: on a GPU serving a
large model the weights' read dominates and a row (a running branch) adds little;
on a CPU every row adds its own compute. Re-branching rules read the fit from
``Load`` to tell whether more rows are nearly free (``sart.Reshare``'s
``row_budget``). The scheduler times each ``Decode`` from the ``now`` it was
emitted at to the ``now`` its answer was handled, divided by the steps it ran,
and fits the line by least squares with exponential forgetting, so it follows an
engine whose speed drifts. Pure arithmetic on the times it is given.
"""

from __future__ import annotations

FORGET = 0.995
"""Each new observation's weight over the previous one's: about the last 200
decode calls count."""

MIN_STEP = 5e-4
"""Mean seconds per step below which nothing is fitted: a model's decode step takes
a millisecond or more, so a faster one is the clock timing sart's own Python (the
fake engine's), whose noise must not steer a policy."""

MIN_SPREAD = 1.0
"""The rows' weighted variance below which the slope is not fitted (a batch whose
size never moved says nothing about a row's cost)."""


class StepCost:
    """Least-squares fit of seconds per decode step against the rows decoded."""

    def __init__(self, forget: float = FORGET) -> None:
        self._forget = forget
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows x seconds
        self._started: tuple[float, int] | None = None
        self._fit: tuple[float, float] | None = None
        self._fitted = True  # ``_fit`` is the fit of ``_sums`` (read far more than fed)

    def started(self, now: float, rows: int) -> None:
        """A ``Decode`` of ``rows`` running branches was emitted at ``now``."""
        self._started = (now, rows)

    def finished(self, now: float, steps: int) -> None:
        """The last ``Decode`` emitted was answered at ``now``, after ``steps`` steps."""
        if self._started is None:
            return
        began, rows = self._started
        self._started = None
        if steps <= 0 or rows <= 0 or now <= began:
            return
        seconds = (now - began) / steps
        decay = self._forget
        w, x, y, xx, xy = (s * decay for s in self._sums)
        self._sums = [w + 1.0, x + rows, y + seconds, xx + rows * rows, xy + rows * seconds]
        self._fitted = False

    def fit(self) -> tuple[float, float] | None:
        """``(fixed, per_row)`` seconds of a step, or ``None`` before the rows have
        varied enough to tell them apart, or while steps take under ``MIN_STEP``.
        ``per_row`` is never negative."""
        if not self._fitted:
            self._fit, self._fitted = self._solve(), True
        return self._fit

    def _solve(self) -> tuple[float, float] | None:
        w, x, y, xx, xy = self._sums
        if w <= 0:
            return None
        mean_x, mean_y = x / w, y / w
        if mean_y < MIN_STEP:
            return None
        spread = xx / w - mean_x * mean_x
        if spread < MIN_SPREAD:
            return None
        per_row = max(0.0, (xy / w - mean_x * mean_y) / spread)
        fixed = mean_y - per_row * mean_x
        if fixed <= 0:  # all of a step's time is in its rows: priced at the mean row
            return 0.0, mean_y / mean_x
        return fixed, per_row
