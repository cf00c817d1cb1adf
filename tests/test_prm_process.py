"""``PRMProcess``: a PRM in a child process answers as it would in this one, failures included."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest

import sart
from sart.prm.process import PRMProcess
from sart.testing import FakeEngine, ScriptedPRM, random_scripts

_random = random_scripts(seed=4, median_length=40, every=8)
#: A plain table (it pickles, unlike the cached function) for the child to rebuild.
SCRIPT = {f"q{i}": [_random(sart.BranchId(f"q{i}", j)) for j in range(4)] for i in range(6)}


def scripted(**kwargs: object) -> ScriptedPRM:
    return ScriptedPRM(SCRIPT, every=8, **kwargs)


class Broken:
    """A PRM whose constructor fails (the child reports it and exits)."""

    def __init__(self) -> None:
        raise OSError("no weights here")

    def score(self, items: Sequence[sart.ScoreItem]) -> list[float]:  # pragma: no cover
        return []


def requests() -> list[sart.Request]:
    return [
        sart.Request(
            f"q{i}", "p", sart.sart(4, interval=8), sampling=sart.SamplingSettings(max_tokens=90)
        )
        for i in range(6)
    ]


@pytest.fixture(scope="module")
def remote():
    with PRMProcess(functools.partial(scripted)) as prm:
        yield prm


def test_runs_give_the_same_results_as_the_prm_in_this_process(remote: PRMProcess) -> None:
    here = sart.run(requests(), FakeEngine(SCRIPT), scripted(), batch_size=12)
    there = sart.run(requests(), FakeEngine(SCRIPT), remote, batch_size=12)
    assert there == here
    assert all(r.ok for r in there)


def test_failures_come_back_attributed_or_isolated() -> None:
    failing = sart.BranchId("q1", 2)
    for attribute in (True, False):
        factory = functools.partial(scripted, fail_on=[failing], attribute_failures=attribute)
        with PRMProcess(factory) as prm:
            results = sart.run(requests(), FakeEngine(SCRIPT), prm, batch_size=12)
            # Only the request whose branch makes the PRM fail fails, either way.
            assert [r.request_id for r in results if not r.ok] == ["q1"]
            assert "injected PRM failure" in (results[1].reason or "")
            with pytest.raises(sart.PRMError if attribute else RuntimeError) as info:
                prm.score([sart.ScoreItem(failing, "p", "x", 1, False)])
            if attribute:
                assert info.value.request_ids == frozenset({"q1"})


def test_a_prm_that_cannot_start_says_why() -> None:
    with pytest.raises(RuntimeError, match="OSError in the PRM process: no weights here"):
        PRMProcess(Broken)


def misconfigured() -> ScriptedPRM:
    raise sart.ConfigError("prm='x/y': no such file or directory")


def test_a_bad_setting_in_the_child_is_a_config_error_here() -> None:
    # The commands print a ConfigError as one line; wrapped in a RuntimeError it was
    # a traceback.
    with pytest.raises(sart.ConfigError, match=r"^prm='x/y': no such file or directory$"):
        PRMProcess(misconfigured)


def test_calls_after_close_fail_as_prm_errors() -> None:
    prm = PRMProcess(functools.partial(scripted))
    prm.close()
    prm.close()  # idempotent
    with pytest.raises(sart.PRMError, match="PRM process is gone"):
        prm.score([])


# ---------------------------------------------------------------- PRMPool: K processes


def test_a_pool_scores_side_by_side_with_the_results_of_one_prm() -> None:
    from sart.prm.process import PRMPool

    here = sart.run(requests(), FakeEngine(SCRIPT), scripted(), batch_size=12)
    with PRMPool(functools.partial(scripted), workers=2) as pool:
        assert pool.workers == 2
        driver = sart.SyncDriver(FakeEngine(SCRIPT), pool, batch_size=12)
        assert driver.scheduler.config.max_scores == 2  # one check in flight per process
        there = driver.run(requests())
        # Each request was placed on one process and kept there; the six spread evenly.
        placed = [pool.placement.placed(f"q{i}") for i in range(6)]
        assert placed == [None] * 6  # released as each request finished
    # On a virtual clock the rewards, not the timing, decide: the same results.
    assert [(r.answer, r.chosen) for r in there] == [(r.answer, r.chosen) for r in here]


def test_a_pool_process_that_fails_fails_only_the_requests_it_held() -> None:
    from sart.prm.process import PRMPool
    from sart.rewards import score_items

    failing = sart.BranchId("q1", 2)
    factory = functools.partial(scripted, fail_on=[failing], attribute_failures=False)
    with PRMPool(factory, workers=2) as pool:
        items = [
            sart.ScoreItem(sart.BranchId(f"q{i}", j), "p", "x" * 8, 8, False)
            for i in range(4)
            for j in range(4)
        ]
        scored = score_items(pool, items)
        assert set(scored.failures) == {"q1"}
        assert {b.request_id for b in scored.rewards} == {"q0", "q2", "q3"}
        assert pool.placement.load() == [2, 2]


def test_a_pool_that_cannot_start_stops_what_did_start() -> None:
    from sart.prm.process import PRMPool

    with pytest.raises(RuntimeError, match="no weights here"):
        PRMPool(Broken, workers=2)
    with pytest.raises(sart.ConfigError, match="workers=0 must be an int >= 1"):
        PRMPool(Broken, workers=0)
