"""The lockstep rules of streaming engines (``sart.engines.lockstep``), on buffers."""

from __future__ import annotations

import attrs

from sart.engines.lockstep import horizon, request_reach
from sart.types import FinishReason

STOP = FinishReason.STOP


@attrs.define
class Buf:
    pending: list
    finish: FinishReason | None = None


def buf(tokens: int, ended: bool = False) -> Buf:
    return Buf(list(range(tokens)), STOP if ended else None)


def test_horizon_waits_for_the_slowest_running_stream() -> None:
    assert horizon([buf(8), buf(3)], 8, False) is None
    assert horizon([buf(8), buf(9)], 8, False) == 8


def test_horizon_stops_at_the_last_end_when_every_stream_ends_sooner() -> None:
    assert horizon([buf(2, ended=True), buf(5, ended=True)], 8, False) == 5
    assert horizon([buf(2, ended=True), buf(5, ended=True)], 8, True) == 2


def test_horizon_until_first_end_waits_for_slower_streams_to_reach_the_end() -> None:
    # A stream that ends at 3: the other must have produced 3 first (it could end sooner).
    assert horizon([buf(3, ended=True), buf(2)], 8, True) is None
    assert horizon([buf(3, ended=True), buf(3)], 8, True) == 3


def test_request_reach_never_waits_and_says_when_the_scheduler_must_look() -> None:
    assert request_reach([buf(0), buf(5)], 8, False) == (0, False)  # one still in prefill
    assert request_reach([buf(8), buf(9)], 8, False) == (8, True)  # the chunk's end
    assert request_reach([buf(4, ended=True), buf(6)], 8, True) == (4, True)  # first end
    # Without until_first_end an end inside the chunk waits for the chunk's end.
    assert request_reach([buf(4, ended=True), buf(6)], 8, False) == (3, False)
    assert request_reach([buf(2, ended=True), buf(3, ended=True)], 8, False) == (3, True)
