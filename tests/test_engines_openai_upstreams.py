"""Which upstream a gateway's request and branches go to (``sart.engines.openai_upstreams``)."""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("httpx")

from sart.engines.openai_upstreams import Upstreams
from sart.engines.openai_wire import Server


@attrs.define
class Req:
    home: int | None


def upstreams(n: int) -> Upstreams:
    return Upstreams([Server(f"http://s{i}") for i in range(n)])


def test_requests_spread_before_any_of_their_branches_start() -> None:
    # Prefills of one scheduler step run concurrently: each counts at once, so they
    # do not all land on the server that had no branch yet.
    up = upstreams(3)
    homes = [up.home() for _ in range(6)]
    assert homes == [0, 1, 2, 0, 1, 2]
    assert [s.requests for s in up.servers] == [2, 2, 2]
    up.leave(Req(1))
    assert up.home() == 1


def test_a_branch_follows_its_home_and_a_failed_home_moves_the_request() -> None:
    up = upstreams(3)
    request = Req(up.home())
    assert up.pick(set(), request) == 0 == request.home
    moved = up.pick({0}, request)  # its home failed this branch
    assert moved != 0 and request.home == moved
    assert up.servers[0].requests == 0 and up.servers[moved].requests == 1
    up.servers[1].live, up.servers[2].live = 5, 1  # without affinity: least live first
    assert up.pick({2}) == 0 and up.pick(set(), None) == 0
    assert up.pick({0, 1, 2}) in (0, 1, 2)  # every server tried: any of them again


def test_a_server_that_failed_is_passed_over_until_its_cooldown_ends() -> None:
    now = [0.0]
    up = Upstreams([Server(f"http://s{i}") for i in range(3)], cooldown=5.0, clock=lambda: now[0])
    up.failed(0)
    assert up.down(0) and not up.down(1)
    assert [up.home() for _ in range(4)] == [1, 2, 1, 2]  # 0 is passed over
    assert up.pick({1}) == 2
    up.failed(2)
    assert up.pick({1}) in (0, 2)  # every other is tried or down: a down one again
    now[0] = 5.5
    assert not up.down(0) and not up.down(2)
    up.failed(1)
    up.answered(1)  # it answered after all (a health probe, a later attempt)
    assert not up.down(1)
