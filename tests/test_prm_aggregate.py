"""Steps and step rewards (``sart.prm.aggregate``): pure Python, no torch needed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.errors import ConfigError, PRMError
from sart.prm.aggregate import (
    AGGREGATIONS,
    NO_STEPS_REWARD,
    aggregate,
    check_aggregation,
    check_finite,
    split_steps,
)
from sart.prm.base import ScoreItem
from sart.types import BranchId


def test_aggregations_by_hand() -> None:
    rewards = [0.9, 0.5, 0.8]
    assert aggregate(rewards, "last") == 0.8
    assert aggregate(rewards, "min") == 0.5
    assert aggregate(rewards, "prod") == pytest.approx(0.36)
    assert aggregate(rewards, "mean") == pytest.approx(2.2 / 3)
    assert aggregate(rewards) == 0.5  # min is the default
    for how in ("last", "min", "prod", "mean"):
        assert aggregate([], how) == NO_STEPS_REWARD
        assert isinstance(aggregate([1, 0], how), float)
    with pytest.raises(ConfigError, match="aggregate='max' must be one of"):
        aggregate(rewards, "max")
    with pytest.raises(ConfigError):
        check_aggregation("median")


def test_split_steps_drops_blank_pieces_and_keeps_the_partial_last_step() -> None:
    assert split_steps("") == []
    assert split_steps("\n\n \n\n") == []
    assert split_steps("a\n\nb\n\nc") == ["a", "b", "c"]
    assert split_steps("a\n\n\n\n\n\nb par") == ["a", "b par"]
    assert split_steps("a\n\nb\n\n") == ["a", "b"]
    assert split_steps("one\nline\n\ntwo") == ["one\nline", "two"]
    # Growing text never changes a step that is followed by another.
    text = "s1 x\n\n\n s2\n\n\n\n\ns3 end"
    for n in range(len(text) + 1):
        now, later = split_steps(text[:n]), split_steps(text)
        assert now[:-1] == later[: max(len(now) - 1, 0)]


step_rewards = st.lists(st.floats(0.0, 1.0), max_size=12)


@given(step_rewards)
def test_every_aggregate_of_rewards_in_the_unit_interval_stays_in_it(rewards: list[float]) -> None:
    got = {how: aggregate(rewards, how) for how in AGGREGATIONS}
    assert all(isinstance(r, float) and 0.0 <= r <= 1.0 for r in got.values())
    if not rewards:
        assert set(got.values()) == {NO_STEPS_REWARD}
        return
    assert got["last"] == rewards[-1]
    assert got["min"] == min(rewards)
    assert got["prod"] <= got["min"] + 1e-12  # the product falls with every step
    assert got["min"] <= got["mean"] + 1e-12 and got["mean"] <= max(rewards) + 1e-12


def test_check_aggregation_returns_the_name_and_lists_the_choices() -> None:
    assert [check_aggregation(how) for how in AGGREGATIONS] == list(AGGREGATIONS)
    with pytest.raises(ConfigError, match=r"aggregate='median' must be one of \['last', 'mean'"):
        check_aggregation("median")


@given(st.text(alphabet="ab \n", max_size=40))
def test_steps_are_the_non_blank_pieces_between_blank_lines(text: str) -> None:
    steps = split_steps(text)
    assert all("\n\n" not in step and step.strip() for step in steps)
    assert "".join(steps) == "".join(p for p in text.split("\n\n") if p.strip())
    more = split_steps(text + "b")  # growing text never changes a step followed by another
    assert more[: max(len(steps) - 1, 0)] == steps[:-1]


def item(rid: str, index: int = 0) -> ScoreItem:
    return ScoreItem(BranchId(rid, index), "q", "text", 4, False)


def test_check_finite_names_the_requests_with_nan_or_infinite_step_rewards() -> None:
    items = [item("ok"), item("nan"), item("inf", 1), item("blank")]
    check_finite(items[:1], [[0.2, 1.0]])
    check_finite([item("blank")], [[]])  # no step rewards: nothing to refuse
    results = [[0.5], [0.1, math.nan], [math.inf], []]
    with pytest.raises(PRMError, match=r"non-finite step rewards for branch .*nan.*inf") as info:
        check_finite(items, results)
    assert info.value.request_ids == {"nan", "inf"}
