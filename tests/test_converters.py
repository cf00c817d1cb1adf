"""The typed attrs converters (``sart.converters``) and the fields that use them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart import converters
from sart.bench.config import BenchConfig
from sart.errors import ConfigError
from sart.serve.config import ServeConfig
from sart.types import Admission, SamplingSettings, Scoring


@given(st.lists(st.floats(allow_nan=False)))
def test_floats_keep_the_items_in_order(items: list[float]) -> None:
    out = converters.floats(items)
    assert type(out) is tuple
    assert list(out) == items


@pytest.mark.parametrize(
    ("convert", "items", "expected"),
    [
        (converters.ints, [3, 1, 2], (3, 1, 2)),
        (converters.strs, ["b", "a"], ("b", "a")),
        (converters.bools, [True, False, True], (True, False, True)),
        (converters.floats, iter([0.5, 1.0]), (0.5, 1.0)),  # any iterable, read once
    ],
)
def test_each_converter_makes_a_tuple(
    convert: Callable[[Any], tuple[Any, ...]], items: Any, expected: tuple[Any, ...]
) -> None:
    assert convert(items) == expected


def test_fields_take_lists_and_keep_tuples() -> None:
    assert SamplingSettings(stop=["\n\n", "###"]).stop == ("\n\n", "###")
    assert ServeConfig(models=["testbed"]).models == ("testbed",)


@pytest.mark.parametrize("config", [ServeConfig, BenchConfig])
def test_scoring_and_admission_by_name_or_refused_by_name(config: type) -> None:
    extra = {"models": ("testbed",)} if config is ServeConfig else {}
    built = config(scoring="blocking", **extra)
    assert built.scoring is Scoring.BLOCKING
    with pytest.raises(ConfigError, match=r"scoring='later' must be one of 'blocking'"):
        config(scoring="later", **extra)
    if config is ServeConfig:
        assert config(admission="token", **extra).admission is Admission.TOKEN
        with pytest.raises(ConfigError, match=r"admission='never' must be one of"):
            config(admission="never", **extra)
