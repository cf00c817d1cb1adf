"""``Placement``: which worker of a PRM pool scores a request (sticky, least loaded)."""

from __future__ import annotations

from sart.prm.placement import Placement


def test_requests_stay_where_they_were_placed_least_loaded_first() -> None:
    placement = Placement(3)
    assert [placement.of(r) for r in ("a", "b", "c", "d")] == [0, 1, 2, 0]
    assert placement.of("b") == 1  # sticky
    assert placement.split(["a", "e", "b", "a"]) == {0: [0, 3], 1: [1, 2]}  # e: least loaded
    assert placement.load() == [2, 2, 1]
    assert placement.release("a") == 0 and placement.release("a") is None
    assert placement.of("f") == 0


def test_a_worker_marked_down_takes_no_requests_until_its_cooldown_ends() -> None:
    now = [0.0]
    placement = Placement(2, cooldown=10.0, clock=lambda: now[0])
    assert (placement.of("a"), placement.of("b")) == (0, 1)
    placement.mark_down(1)
    assert placement.placed("b") is None  # placed again at its next check
    assert (placement.of("b"), placement.of("c")) == (0, 0)
    now[0] = 10.0
    assert placement.of("d") == 1  # up again: the least loaded
    placement.mark_down(0)
    placement.mark_down(1)
    assert placement.of("e") == 0  # every worker down: try anyway
