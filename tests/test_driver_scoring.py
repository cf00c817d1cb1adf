"""How the drivers carry out PRM checks: blocking or overlapped, priced or timed.

On a virtual clock a ``CostedPRM`` call takes its modelled time; on the wall
clock overlapped checks run on a worker thread while the loop keeps decoding.
These tests pin what each mode does, not how fast it is (that is
``benchmarks/``' and ``sart bench``'s job).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

import sart
from sart.testing import BranchScript, FakeEngine, FakeStreamingEngine, ScriptedPRM, random_scripts

SCRIPT = random_scripts(seed=11, median_length=60, every=8)


def requests(count: int = 6, with_sc: bool = True) -> list[sart.Request]:
    return [
        sart.Request(
            f"q{i}",
            "p",
            sart.self_consistency(4, interval=8)
            if with_sc and i % 3 == 0
            else sart.sart(4, interval=8),
            sampling=sart.SamplingSettings(max_tokens=120),
        )
        for i in range(count)
    ]


def run_priced(
    scoring: sart.Scoring, cost: float, *, shares_engine: bool = False, with_sc: bool = True
):
    engine = FakeEngine(SCRIPT)
    scripted = ScriptedPRM(SCRIPT, every=8)
    prm = sart.CostedPRM(scripted, lambda _items: cost, shares_engine=shares_engine)
    driver = sart.SyncDriver(engine, prm, batch_size=12, scoring=scoring)
    return driver, driver.run(requests(with_sc=with_sc)), scripted


def test_a_priced_prm_blocks_decoding_only_when_checks_block() -> None:
    blocking, slow, calls = run_priced(sart.Scoring.BLOCKING, 5.0)
    overlapped, fast, _ = run_priced(sart.Scoring.OVERLAPPED, 5.0)
    assert all(r.ok for r in slow + fast)
    # Blocking: every call stalls the loop for its whole cost.
    assert blocking.prm_busy == pytest.approx(5.0 * calls.calls)
    # (calls made when no branch is running hold nothing up)
    assert 0 < blocking.prm_wait <= blocking.prm_busy
    # Overlapped: the PRM works as long, the loop waits far less, the run ends sooner.
    assert overlapped.prm_busy > 0
    assert overlapped.prm_wait < 0.5 * overlapped.prm_busy
    assert max(r.timings.finished for r in fast) < max(r.timings.finished for r in slow)
    # Time is charged to the requests that used the PRM or were held up by it.
    for result in slow:
        assert result.prm_wait_seconds > 0
        assert (result.prm_seconds > 0) == (result.prm_items > 0)
    assert sum(r.prm_seconds for r in slow) == pytest.approx(blocking.prm_busy)


def test_a_prm_sharing_the_engine_gains_nothing_from_overlap() -> None:
    # Every request uses the PRM: on one accelerator, nothing can run beside it.
    _, blocking, _ = run_priced(sart.Scoring.BLOCKING, 5.0, with_sc=False)
    _, shared, _ = run_priced(sart.Scoring.OVERLAPPED, 5.0, shares_engine=True, with_sc=False)
    assert shared == blocking


def test_a_free_prm_makes_both_modes_serve_every_request_alike() -> None:
    _, blocking, _ = run_priced(sart.Scoring.BLOCKING, 0.0)
    _, overlapped, _ = run_priced(sart.Scoring.OVERLAPPED, 0.0)
    assert blocking == overlapped


class SlowPRM:
    """A ScriptedPRM that takes ``delay`` seconds of wall time per call, and records
    which thread called it, how far the engine decoded meanwhile, and whether a
    ``release`` ever ran during a call."""

    def __init__(self, engine: FakeEngine, delay: float) -> None:
        self.scripted = ScriptedPRM(SCRIPT, every=8)
        self.engine = engine
        self.delay = delay
        self.threads: set[str] = set()
        self.steps_during: list[int] = []
        self.busy = False
        self.released_while_busy = False

    def score(self, items: Sequence[sart.ScoreItem]) -> list[float]:
        self.busy = True
        self.threads.add(threading.current_thread().name)
        before = self.engine.steps
        time.sleep(self.delay)
        self.steps_during.append(self.engine.steps - before)
        self.busy = False
        return self.scripted.score(items)

    def release(self, request_id: str) -> None:
        self.released_while_busy |= self.busy
        self.scripted.release(request_id)


@pytest.mark.parametrize("scoring", list(sart.Scoring))
def test_wall_clock_overlapped_checks_run_beside_decoding(scoring: sart.Scoring) -> None:
    engine = FakeEngine(SCRIPT)
    prm = SlowPRM(engine, delay=0.02)
    driver = sart.SyncDriver(engine, prm, batch_size=12, scoring=scoring, clock=sart.WallClock())
    results = driver.run(requests())
    assert all(r.ok for r in results)
    assert not prm.released_while_busy
    assert sorted(prm.scripted.released) == sorted(r.request_id for r in results)
    if scoring is sart.Scoring.BLOCKING:
        assert prm.threads == {threading.current_thread().name}
        assert set(prm.steps_during) == {0}
        assert driver.prm_wait == pytest.approx(driver.prm_busy, rel=0.2)
    else:
        assert all(name.startswith("sart-prm") for name in prm.threads)
        assert max(prm.steps_during) > 0  # the engine decoded while the PRM worked
    assert driver.prm_busy >= 0.02 * len(prm.steps_during)


def test_async_driver_overlaps_checks_on_a_streaming_engine() -> None:
    decodes_during: list[int] = []
    threads: set[str] = set()

    async def main() -> list[sart.RequestResult]:
        class Probe(ScriptedPRM):
            def score(self, items: Sequence[sart.ScoreItem]) -> list[float]:
                threads.add(threading.current_thread().name)
                before = len(driver.timeline)  # one sample per decode call
                time.sleep(0.02)
                decodes_during.append(len(driver.timeline) - before)
                return super().score(items)

        driver = sart.AsyncDriver(
            FakeStreamingEngine(SCRIPT),
            Probe(SCRIPT, every=8),
            batch_size=12,
            clock=sart.WallClock(),
        )
        return await driver.run(requests())

    results = asyncio.run(main())
    assert all(r.ok for r in results)
    assert all(name.startswith("sart-prm") for name in threads)
    assert max(decodes_during) > 0  # the event loop decoded while the PRM worked


def test_scoring_is_validated_by_name() -> None:
    with pytest.raises(sart.ConfigError, match="scoring='sometimes'"):
        sart.run([], FakeEngine({}), scoring="sometimes")
    script = {"a": [BranchScript(length=3)]}
    (result,) = sart.run(
        [sart.Request("a", "p", sart.vanilla())], FakeEngine(script), scoring="blocking"
    )
    assert result.ok


# ---------------------------------------------------------------- ids and callbacks


def test_a_run_with_repeated_ids_is_refused_before_anything_runs() -> None:
    # Before: the second request's result took both places (or a ConfigError mid-run
    # lost every result).
    engine = FakeEngine(SCRIPT)
    twice = [*requests(2), requests(1)[0]]
    with pytest.raises(sart.ConfigError, match=r"repeated: \['q0'\]"):
        sart.run(twice, engine, ScriptedPRM(SCRIPT, every=8))
    assert engine.log == []
    driver = sart.SyncDriver(engine, ScriptedPRM(SCRIPT, every=8), batch_size=4)
    driver.submit(requests(1)[0])
    with pytest.raises(sart.ConfigError, match="id='q0' must be unique"):
        driver.submit(requests(1)[0])


class CallbackBroke(Exception):
    pass


def test_an_exception_in_on_result_reaches_the_caller() -> None:
    # Before: it failed the Finish command and was counted as a failed cleanup.
    def on_result(result: sart.RequestResult) -> None:
        raise CallbackBroke(result.request_id)

    driver = sart.SyncDriver(
        FakeEngine(SCRIPT), ScriptedPRM(SCRIPT, every=8), batch_size=12, on_result=on_result
    )
    with pytest.raises(CallbackBroke):
        driver.run(requests())
    assert driver.results  # recorded before the callback ran
    assert driver.scheduler.statistics().failed_cleanups == 0


def test_generate_returns_when_on_result_raises_and_serve_reports_it() -> None:
    # Before: generate() waited for ever.
    async def main() -> tuple[list, BaseException | None]:
        driver = sart.AsyncDriver(
            FakeStreamingEngine(SCRIPT),
            ScriptedPRM(SCRIPT, every=8),
            batch_size=12,
            clock=sart.WallClock(),
            on_result=lambda result: (_ for _ in ()).throw(CallbackBroke(result.request_id)),
        )
        server = asyncio.create_task(driver.serve())
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(driver.generate(r) for r in requests(3)), return_exceptions=True),
            timeout=30,
        )
        return outcomes, server.exception() if server.done() else None

    outcomes, served = asyncio.run(main())
    assert isinstance(served, CallbackBroke)
    # The first finished request got its result; the others got the server's error.
    assert any(isinstance(o, sart.RequestResult) for o in outcomes)
    assert all(isinstance(o, (sart.RequestResult, CallbackBroke)) for o in outcomes)
