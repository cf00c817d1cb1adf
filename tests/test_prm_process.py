"""``PRMProcess``: a PRM in a child process answers as it would in this one, failures included."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

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


# ---------------------------------------------------------------- a child that dies


def kill(prm: PRMProcess) -> None:
    """Kill the child as the kernel's OOM killer would, and wait until it is gone."""
    process = prm._process  # the test's one look inside: which child to kill
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=30)


def item(request_id: str) -> sart.ScoreItem:
    return sart.ScoreItem(sart.BranchId(request_id, 0), "p", "x" * 8, 8, False)


def test_a_killed_prm_process_is_started_again_at_the_next_call() -> None:
    with PRMProcess(functools.partial(scripted)) as prm:
        before = prm.score([item("q0"), item("q1")])
        kill(prm)
        # Before, every later call failed ("the PRM process is gone"): a server whose
        # PRM process died failed every request that needs rewards, for good.
        assert prm.score([item("q0"), item("q1")]) == before
        prm.release("q0")
        results = sart.run(requests(), FakeEngine(SCRIPT), prm, batch_size=12)
        assert all(r.ok for r in results)


class Slow:
    """A PRM whose checks take a while (time to kill its process during one)."""

    def score(self, items: Sequence[sart.ScoreItem]) -> list[float]:
        time.sleep(1.0)
        return [0.5] * len(items)


def test_a_call_in_flight_when_the_child_dies_is_answered_by_a_new_one() -> None:
    with PRMProcess(Slow) as prm:
        answers: list[object] = []
        caller = threading.Thread(target=lambda: answers.append(prm.score([item("q0")])))
        caller.start()
        time.sleep(0.3)
        kill(prm)
        caller.join(timeout=30)
        assert answers == [[0.5]]


class Crashing:
    """A PRM whose every check takes its process down (a crash in native code)."""

    def score(self, items: Sequence[sart.ScoreItem]) -> list[float]:
        os._exit(3)


def test_a_child_that_dies_again_fails_the_call() -> None:
    with PRMProcess(Crashing) as prm:
        for _ in range(2):  # each call: a start, a death, and a clear error
            with pytest.raises(sart.PRMError, match=r"gone .*exit code 3.*started again"):
                prm.score([item("q0")])


def flaky(marker: str) -> ScriptedPRM:
    """A PRM that cannot be built while ``marker`` exists."""
    if os.path.exists(marker):
        raise OSError("the GPU is busy")
    return scripted()


def test_a_child_that_cannot_start_again_is_retried_after_a_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "broken"
    with PRMProcess(functools.partial(flaky, str(marker))) as prm:
        marker.touch()
        kill(prm)
        with pytest.raises(sart.PRMError, match=r"could not start again: .*the GPU is busy"):
            prm.score([item("q0")])
        started = time.monotonic()
        with pytest.raises(sart.PRMError, match="could not start again"):
            prm.score([item("q0")])  # within the backoff: at once, no new start
        assert time.monotonic() - started < 1
        marker.unlink()
        monkeypatch.setattr("sart.prm.process.RESTART_BACKOFF", 0.0)
        prm._retry_at = 0.0  # the backoff is over
        assert len(prm.score([item("q0")])) == 1
