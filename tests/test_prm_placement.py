"""``Placement``: which worker of a PRM pool scores a request (sticky, least loaded)."""

from __future__ import annotations

import pytest

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


def test_fan_out_sends_each_worker_its_requests_and_sorts_out_the_answers() -> None:
    import concurrent.futures

    from sart.errors import PRMError
    from sart.prm.placement import fan_out

    placement = Placement(3, cooldown=60.0)
    ids = ["a", "b", "c", "a", "d"]  # a, b, c on workers 0, 1, 2; d on 0

    def call(worker: int, held: list[int]) -> list[str]:
        if worker == 1:
            raise PRMError("worker 1 is gone")  # names no request: all it held fail
        if worker == 2:
            raise PRMError("c's input is bad", ["c"])
        return [ids[k] for k in held]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        out = fan_out(placement, pool, ids, call, mark_down=True)
        assert out.held == {0: [0, 3, 4], 1: [1], 2: [2]}
        assert out.answers == {0: ["a", "a", "d"]}
        assert out.failed == {"b": "worker 1 is gone", "c": "c's input is bad"}
        with pytest.raises(PRMError) as caught:
            out.raise_failures()
        assert caught.value.request_ids == frozenset({"b", "c"})
        # Both failed workers are out of new placements; a's stays.
        assert placement.of("e") == 0 and placement.of("a") == 0

        def buggy(worker: int, held: list[int]) -> None:
            raise KeyError("a bug, not a worker's failure")

        with pytest.raises(KeyError):
            fan_out(Placement(2), pool, ["x", "y"], buggy).raise_failures()
