"""The asyncio driver: same results as the synchronous one, and a serving mode."""

from __future__ import annotations

import asyncio

import sart
from sart.testing import (
    BranchScript,
    FakeEngine,
    FakeStreamingEngine,
    ScriptedPRM,
    random_scripts,
)
from sart.types import BranchId

SCRIPT = random_scripts(seed=3, median_length=24, every=6)


def requests() -> list[sart.Request]:
    policies = [
        sart.sart(4, interval=6),
        sart.self_consistency(3, interval=6),
        sart.vanilla(interval=6),
        sart.rebase(3, interval=6),
    ]
    return [
        sart.Request(f"q{i}", "p", policies[i % 4], sampling=sart.SamplingSettings(max_tokens=60))
        for i in range(8)
    ]


def outcome(results: list[sart.RequestResult]) -> list[tuple]:
    return [
        (r.request_id, r.status, r.answer, [(b.status, b.num_tokens) for b in r.branches])
        for r in results
    ]


def test_async_driver_on_a_streaming_engine_matches_the_sync_driver() -> None:
    sync = sart.run(
        requests(),
        FakeEngine(SCRIPT),
        ScriptedPRM(SCRIPT, every=6),
        batch_size=10,
        clock=sart.VirtualClock(),
    )

    async def main() -> list[sart.RequestResult]:
        driver = sart.AsyncDriver(
            FakeStreamingEngine(SCRIPT),
            ScriptedPRM(SCRIPT, every=6),
            batch_size=10,
            clock=sart.VirtualClock(),
        )
        return await driver.run(requests())

    assert outcome(asyncio.run(main())) == outcome(sync)


def test_async_driver_also_runs_step_based_engines() -> None:
    engine = FakeEngine(SCRIPT)

    async def main() -> list[sart.RequestResult]:
        driver = sart.AsyncDriver(engine, ScriptedPRM(SCRIPT, every=6), batch_size=10)
        return await driver.run(requests())

    results = asyncio.run(main())
    assert all(r.ok for r in results)
    assert not engine.live_branches and not engine.prefixes


def test_serving_concurrent_callers() -> None:
    async def main() -> list[sart.RequestResult]:
        engine = FakeStreamingEngine(SCRIPT)
        driver = sart.AsyncDriver(engine, ScriptedPRM(SCRIPT, every=6), batch_size=6)
        server = asyncio.create_task(driver.serve())
        first = await driver.generate(requests()[0])  # one caller, then several at once
        rest = await asyncio.gather(*(driver.generate(r) for r in requests()[1:]))
        driver.stop()
        await asyncio.wait_for(server, timeout=10)
        assert engine.stats().live_branches == 0
        return [first, *rest]

    results = asyncio.run(main())
    assert [r.request_id for r in results] == [f"q{i}" for i in range(8)]
    assert all(r.ok for r in results)


def test_a_failing_stream_fails_only_its_request() -> None:
    script = {"a": [BranchScript(length=30)] * 2, "b": [BranchScript(length=30)] * 2}

    async def main() -> list[sart.RequestResult]:
        engine = FakeStreamingEngine(script, fail_stream={BranchId("a", 1): 12})
        driver = sart.AsyncDriver(engine, batch_size=4)
        return await driver.run(
            [sart.Request(r, "p", sart.self_consistency(2, interval=5)) for r in ("a", "b")]
        )

    a, b = asyncio.run(main())
    assert not a.ok and "injected stream failure" in (a.reason or "")
    assert b.ok


def test_a_cancelled_generate_cancels_its_request_and_frees_its_branches() -> None:
    script = {"a": [BranchScript(length=400)] * 3, "b": [BranchScript(length=20)] * 2}

    async def main() -> tuple[sart.RequestResult, list[sart.RequestResult]]:
        engine = FakeStreamingEngine(script)
        driver = sart.AsyncDriver(engine, batch_size=8)
        server = asyncio.create_task(driver.serve())
        slow = asyncio.create_task(
            driver.generate(sart.Request("a", "p", sart.self_consistency(3, interval=5)))
        )
        while engine.stats().live_branches < 3:  # a is decoding
            await asyncio.sleep(0)
        slow.cancel()  # its caller went away
        b = await driver.generate(sart.Request("b", "p", sart.self_consistency(2, interval=5)))
        driver.stop()
        await asyncio.wait_for(server, timeout=10)
        assert slow.cancelled()
        assert engine.stats().live_branches == 0
        assert engine.stats().kv_tokens == 0  # its prompt too
        return b, driver.results

    b, results = asyncio.run(main())
    assert b.ok
    (a,) = [r for r in results if r.request_id == "a"]
    assert a.status is sart.RequestStatus.CANCELLED
    assert all(0 < x.num_tokens < 400 for x in a.branches)


def test_a_refused_duplicate_id_leaves_the_first_caller_its_result() -> None:
    async def main() -> sart.RequestResult:
        driver = sart.AsyncDriver(FakeStreamingEngine(SCRIPT), batch_size=6)
        server = asyncio.create_task(driver.serve())
        request = sart.Request("q1", "p", sart.self_consistency(3, interval=6))
        first = asyncio.create_task(driver.generate(request))
        await asyncio.sleep(0)  # the first is submitted
        try:
            await driver.generate(request)
        except sart.ConfigError as exc:
            assert "id='q1' must be unique" in str(exc)
        else:
            raise AssertionError("a second request with the same id was taken")
        result = await asyncio.wait_for(first, timeout=10)
        driver.stop()
        await asyncio.wait_for(server, timeout=10)
        return result

    assert asyncio.run(main()).ok
