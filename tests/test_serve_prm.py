"""``ServedPRM`` passes on how many checks its PRM takes side by side, so the server keeps
as many in flight as the PRM has workers (a ``PRMPool``, PRM servers)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

pytest.importorskip("fastapi")

from sart.prm.base import ScoreItem
from sart.serve.config import ServeConfig
from sart.serve.prm import ServedPRM
from sart.serve.service import Service
from sart.testing import FakeEngine


class Pool:
    workers = 3

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        return [0.5] * len(items)


def test_the_server_keeps_as_many_checks_in_flight_as_its_prm_has_workers() -> None:
    assert ServedPRM(Pool(), lambda *_: None).workers == 3
    assert ServedPRM(object(), lambda *_: None).workers == 1  # type: ignore[arg-type]
    service = Service(FakeEngine({}), Pool(), ServeConfig(models=("m",)))
    assert service.driver.scheduler.config.max_scores == 3
    blocking = Service(FakeEngine({}), Pool(), ServeConfig(models=("m",), scoring="blocking"))
    assert blocking.driver.scheduler.config.max_scores == 1  # Algorithm 1: one at a time
