"""The scheduler's fit of a decode step's cost against its rows (``StepCost``)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sart
from sart.engines.sim import SimEngine
from sart.policies.base import AdmitRule
from sart.scheduler.step_cost import StepCost
from sart.testing import BranchScript
from strategies import CPU_LIKE


def observe(cost: StepCost, rows: int, per_step: float, steps: int = 4, at: float = 0.0) -> float:
    cost.started(at, rows)
    cost.finished(at + per_step * steps, steps)
    return at + per_step * steps


@given(
    fixed=st.floats(1e-3, 1e-1),
    per_row=st.floats(0.0, 1e-2),
    rows=st.lists(st.integers(1, 64), min_size=3, max_size=40),
)
def test_a_linear_engine_is_fitted_exactly(fixed: float, per_row: float, rows: list[int]) -> None:
    cost, now = StepCost(), 0.0
    for r in rows:
        now = observe(cost, r, fixed + per_row * r, at=now)
    mean = sum(rows) / len(rows)
    # The fit's spread weighs older steps less (FORGET): over 40 steps at least 0.82
    # of the plain variance here, so 1.25 keeps it over MIN_SPREAD (at exactly 1.0
    # the weighted spread fell just under it: rows [12, 12, 14, 14]).
    if sum((r - mean) ** 2 for r in rows) / len(rows) < 1.25:
        return  # too little spread: covered below
    got = cost.fit()
    assert got is not None
    assert got[0] == pytest.approx(fixed, rel=1e-6, abs=1e-9)
    assert got[1] == pytest.approx(per_row, rel=1e-6, abs=1e-9)


def test_no_fit_before_the_rows_vary_and_nothing_from_empty_decodes() -> None:
    cost = StepCost()
    assert cost.fit() is None
    for _ in range(5):
        observe(cost, 8, 0.004)
    assert cost.fit() is None  # one batch size: a row's cost is unknown
    cost.started(1.0, 4)
    cost.finished(2.0, 0)  # no step ran
    cost.finished(3.0, 4)  # no decode in flight
    assert cost.fit() is None
    observe(cost, 2, 0.003)
    observe(cost, 16, 0.006)
    fixed, per_row = cost.fit() or (0.0, 0.0)
    assert fixed > 0 and per_row > 0


def test_steps_faster_than_a_model_s_are_not_fitted() -> None:
    # The fake engine's steps take microseconds of sart's own Python: its rows look
    # costly, but that noise must not decide whether a policy forks.
    cost, now = StepCost(), 0.0
    for i in range(50):
        now = observe(cost, 1 + i % 8, 1e-5 * (1 + i % 8), at=now)
    assert cost.fit() is None


def test_it_follows_an_engine_that_slows_down() -> None:
    cost, now = StepCost(), 0.0
    for i in range(400):
        now = observe(cost, 2 + i % 16, 0.002 + 0.0001 * (2 + i % 16), at=now)
    for i in range(1000):
        now = observe(cost, 2 + i % 16, 0.004 + 0.0004 * (2 + i % 16), at=now)
    fixed, per_row = cost.fit() or (0.0, 0.0)
    assert fixed == pytest.approx(0.004, rel=0.05) and per_row == pytest.approx(0.0004, rel=0.05)


def test_policies_see_the_engine_s_cost_in_their_load() -> None:
    # The simulator prices a step at 2 ms + 1 ms a row on its virtual clock; request
    # "a" decodes with 8, 7, ..., 1 rows, and "b", admitted after it, sees the fit.
    seen: list[sart.Load] = []

    @attrs.frozen
    class Watch(AdmitRule):
        def admit(self, policy: sart.Policy, load: sart.Load) -> sart.Policy:
            seen.append(load)
            return policy

    scripts = {
        "a": [BranchScript(length=10 * (i + 1)) for i in range(8)],
        "b": [BranchScript(length=10)],
    }
    engine = SimEngine(scripts, cost=CPU_LIKE)
    policy = sart.self_consistency(8, interval=4)
    later = attrs.evolve(policy, n=1, admit=Watch())
    sart.run(
        [sart.Request("a", "p", policy, arrival=0.0), sart.Request("b", "p", later, arrival=1.0)],
        engine,
        batch_size=8,
    )
    (load,) = seen
    assert load.step_fixed == pytest.approx(2e-3, rel=0.1)
    assert load.step_per_row == pytest.approx(1e-3, rel=0.1)
    assert load.rows_cost(2) == pytest.approx(1.0, rel=0.2)
