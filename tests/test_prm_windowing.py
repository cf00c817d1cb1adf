"""The PRM context window (``sart.prm.window``): pure Python on token ids, no torch needed.

The bounded mode on real PRMs (transformers, vLLM) is tested in
``tests/test_prm_window.py``.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sart.errors import ConfigError
from sart.prm.window import OVERFLOW_MODES, ContextLimit, ContextOverflow, Encoded, fit_context


def test_fit_context_by_hand() -> None:
    enc = Encoded((1,) * 10, ((2,) * 5, (3,) * 5, (4,) * 5, (5,) * 5), (4, 4, 4, 4))
    assert fit_context(enc, ContextLimit(30)) is enc
    kept = fit_context(enc, ContextLimit(24))  # room for 14: the last two steps
    assert kept.segments == enc.segments[2:] and kept.prefix == enc.prefix
    assert kept.first_step == 2 and kept.positions() == [14, 19]
    # stride 10: the window starts at step offset 10 whatever the room beyond 15 tokens
    assert fit_context(enc, ContextLimit(27, window_stride=10)).first_step == 2
    assert fit_context(enc, ContextLimit(27)).first_step == 1
    # one huge last step: its end is kept, rating token included
    huge = Encoded((1,) * 10, ((2,) * 5, tuple(range(100))), (4, 99))
    kept = fit_context(huge, ContextLimit(20))
    assert len(kept) == 20 and kept.segments == (tuple(range(90, 100)),) and kept.rating == (9,)
    # a prefix longer than the context loses its beginning; steps get half the room
    long_prefix = Encoded(tuple(range(50)), ((2,) * 5, (3,) * 20), (4, 19))
    kept = fit_context(long_prefix, ContextLimit(32))
    assert kept.prefix == tuple(range(34, 50)) and kept.segments == ((3,) * 16,)
    with pytest.raises(Exception, match="over max_length=20"):
        fit_context(enc, ContextLimit(20, overflow="error"))


def test_window_by_hand() -> None:
    enc = Encoded((1,) * 10, ((2,) * 5, (3,) * 5, (4,) * 5, (5,) * 5), (4, 4, 4, 4))
    assert fit_context(enc, ContextLimit(64, window=20)) is enc  # the response fits
    kept = fit_context(enc, ContextLimit(64, window=12))  # the last two steps
    assert kept.prefix == enc.prefix and kept.segments == enc.segments[2:]
    assert kept.first_step == 2 and kept.positions() == [14, 19]
    # the start moves in jumps of window_stride, as with max_length
    assert fit_context(enc, ContextLimit(64, window=17)).first_step == 1
    assert fit_context(enc, ContextLimit(64, window=17, window_stride=10)).first_step == 2
    # a long question is kept whole: the window counts response tokens only
    long_prefix = attrs_evolve(enc, prefix=tuple(range(40)))
    kept = fit_context(long_prefix, ContextLimit(64, window=12))
    assert kept.prefix == tuple(range(40)) and kept.segments == enc.segments[2:]
    # a last step longer than the window: its end, rating token included
    huge = Encoded((1,) * 10, ((2,) * 5, tuple(range(100))), (4, 99))
    kept = fit_context(huge, ContextLimit(64, window=8))
    assert kept.segments == (tuple(range(92, 100)),) and kept.rating == (7,)
    # max_length still applies after the window; first_step counts both cuts
    kept = fit_context(enc, ContextLimit(20, window=15))
    assert len(kept) == 20 and kept.first_step == 2 and kept.segments == enc.segments[2:]


def attrs_evolve(enc: Encoded, **changes: Any) -> Encoded:
    import attrs

    return attrs.evolve(enc, **changes)


def test_an_input_lists_its_ids_and_rating_positions() -> None:
    enc = Encoded((7, 8), ((1, 2, 3), (4, 5)), (2, 0), first_step=3)
    assert len(enc) == 7
    assert enc.ids() == [7, 8, 1, 2, 3, 4, 5]
    assert enc.positions() == [4, 5]
    assert [enc.ids()[p] for p in enc.positions()] == [3, 4]
    assert len(Encoded((), (), ())) == 0 and Encoded((), (), ()).positions() == []


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("max_length", 15, ">= 16"),
        ("max_length", 64.0, ">= 16"),
        ("overflow", "truncate", f"one of {OVERFLOW_MODES}"),
        ("window_stride", 0, ">= 1"),
        ("window", 0, "None or an int >= 1"),
    ],
)
def test_bad_limits_name_the_field_and_the_value(field: str, value: Any, rule: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(f"{field}={value!r} must be {rule}")):
        ContextLimit(**{field: value})


def test_the_error_mode_raises_context_overflow_only_over_max_length() -> None:
    enc = Encoded((1,) * 10, ((2,) * 5, (3,) * 5), (4, 4))
    strict = ContextLimit(20, overflow="error")
    assert fit_context(enc, strict) is enc  # 20 tokens fit exactly
    with pytest.raises(ContextOverflow, match="21 tokens, over max_length=20"):
        fit_context(attrs.evolve(enc, prefix=(1,) * 11), strict)
    # the window cuts first: a windowed input within max_length is not an overflow
    kept = fit_context(attrs.evolve(enc, prefix=(1,) * 11), ContextLimit(20, "error", window=5))
    assert kept.segments == ((3,) * 5,)


# ---------------------------------------------------------------- properties


@st.composite
def inputs(draw: st.DrawFn) -> Encoded:
    """An input whose tokens say where they come from: prefix token ``1000 + i``,
    token ``j`` of step ``i`` is ``100 * i + j``; ratings anywhere in their step."""
    prefix = tuple(range(1000, 1000 + draw(st.integers(0, 60))))
    lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=10))
    segments = tuple(tuple(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths))
    rating = tuple(draw(st.integers(0, n - 1)) for n in lengths)
    return Encoded(prefix, segments, rating)


limits = st.builds(
    ContextLimit,
    max_length=st.integers(16, 200),
    window_stride=st.integers(1, 20),
    window=st.none() | st.integers(1, 150),
)


@given(inputs(), limits)
def test_a_fitted_input_fits_and_keeps_the_latest_steps_and_their_rating_tokens(
    enc: Encoded, limit: ContextLimit
) -> None:
    kept = fit_context(enc, limit)
    assert len(kept) <= limit.max_length
    if limit.window is not None:
        assert len(kept) - len(kept.prefix) <= limit.window
    # the prefix loses its beginning only; the steps are the latest ones, the last always
    assert kept.prefix == enc.prefix[len(enc.prefix) - len(kept.prefix) :]
    assert kept.first_step + len(kept.segments) == len(enc.segments)
    assert kept.segments[:-1] == enc.segments[kept.first_step : -1]
    last = kept.segments[-1]  # whole, or a run of the original that holds its rating token
    assert last[kept.rating[-1]] == enc.segments[-1][enc.rating[-1]]
    ids = kept.ids()
    for step, position in enumerate(kept.positions(), start=kept.first_step):
        assert ids[position] == enc.segments[step][enc.rating[step]]
    if len(enc) <= limit.max_length and limit.window is None:
        assert kept is enc


@given(inputs(), st.integers(16, 200))
def test_a_long_prefix_leaves_the_steps_half_the_context(enc: Encoded, max_length: int) -> None:
    """Over the context, the prefix keeps its latest tokens and leaves the steps
    ``min(their length, max_length // 2)`` tokens of room."""
    kept = fit_context(enc, ContextLimit(max_length))
    if len(enc) > max_length:
        steps = len(enc) - len(enc.prefix)
        room = max_length - min(steps, max_length // 2)
        assert len(kept.prefix) == min(len(enc.prefix), room)
