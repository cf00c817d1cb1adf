"""Streaming engines: independent token streams presented as the step contract."""

from __future__ import annotations

import asyncio

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sart
from sart.engines.base import BranchSpec
from sart.engines.streaming import BranchStart
from sart.engines.sync_bridge import SyncBridge
from sart.testing import (
    BranchScript,
    FakeEngine,
    FakeStreamingEngine,
    ScriptedPRM,
    check_engine,
    random_scripts,
)
from sart.types import BranchId, FinishReason, SamplingSettings


def test_passes_the_conformance_suite_through_the_bridge() -> None:
    check_engine(lambda: SyncBridge(FakeStreamingEngine()))
    check_engine(lambda: SyncBridge(FakeStreamingEngine(burst=1)))


def test_step_waits_for_the_slowest_stream_and_buffers_the_fastest() -> None:
    async def scenario() -> None:
        engine = FakeStreamingEngine({"a": [BranchScript(length=30)] * 3}, burst=9)
        await engine.prefill("a", "p", sart.SamplingSettings(max_tokens=100))
        await engine.start_branches("a", [BranchSpec(j, j) for j in range(3)])
        out = await engine.step(4)
        assert out.steps == 4
        assert {d.new_tokens for d in out.deltas.values()} == {4}
        out = await engine.step(100)  # until every branch ended: at token 30
        assert out.steps == 26
        assert all(d.finish is FinishReason.STOP for d in out.deltas.values())
        assert engine.stats().live_branches == 0

    asyncio.run(scenario())


def test_a_failing_stream_fails_its_request() -> None:
    async def scenario() -> None:
        engine = FakeStreamingEngine(
            {"a": [BranchScript(length=30)] * 2}, fail_stream={BranchId("a", 1): 25}
        )
        await engine.prefill("a", "p", sart.SamplingSettings(max_tokens=100))
        await engine.start_branches("a", [BranchSpec(0, 0), BranchSpec(1, 1)])
        await engine.step(5)
        with pytest.raises(sart.EngineError) as info:
            await engine.step(100)
        assert info.value.request_ids == {"a"}
        await engine.abort([BranchId("a", 0), BranchId("a", 1)])
        await engine.release_prefix("a")

    asyncio.run(scenario())


class _ShortLogprobs(FakeStreamingEngine):
    """Streams chunks whose logprobs are one short of their tokens."""

    async def _open(self, start):  # type: ignore[no-untyped-def, override]
        async for chunk in super()._open(start):
            yield attrs.evolve(chunk, logprobs=chunk.logprobs[1:])


def test_logprobs_that_do_not_match_the_tokens_fail_the_request_not_drop_tokens() -> None:
    async def scenario() -> None:
        engine = _ShortLogprobs({"a": [BranchScript(length=12)]}, burst=3)
        await engine.prefill("a", "p", sart.SamplingSettings(max_tokens=100, logprobs=2))
        await engine.start_branches("a", [BranchSpec(0, 0)])
        with pytest.raises(sart.EngineError, match="logprobs") as info:
            await engine.step(100)
        assert info.value.request_ids == {"a"}

    asyncio.run(scenario())


def test_logprobs_come_one_per_token_through_the_buffer() -> None:
    async def scenario() -> None:
        script = BranchScript(length=30, confidences=(2.0, 5.0), logprob_every=10)
        engine = FakeStreamingEngine({"a": [script] * 2}, burst=7)
        await engine.prefill("a", "p", sart.SamplingSettings(max_tokens=100, logprobs=2))
        await engine.start_branches("a", [BranchSpec(0, 0), BranchSpec(1, 1)])
        first, rest = await engine.step(8), await engine.step(100)
        for bid in (BranchId("a", 0), BranchId("a", 1)):
            tops = [lp.top for lp in first.deltas[bid].logprobs + rest.deltas[bid].logprobs]
            assert tops == [(-2.0, -2.0)] * 10 + [(-5.0, -5.0)] * 20

    asyncio.run(scenario())


def test_abort_cancels_the_stream_on_the_engine() -> None:
    async def scenario() -> None:
        engine = FakeStreamingEngine({"a": [BranchScript(length=30)] * 2})
        await engine.prefill("a", "p", sart.SamplingSettings(max_tokens=100))
        await engine.start_branches("a", [BranchSpec(0, 0), BranchSpec(1, 1)])
        await engine.step(3)
        await engine.abort([BranchId("a", 1)])
        assert engine.cancelled == [BranchId("a", 1)]
        out = await engine.step(100)
        assert set(out.deltas) == {BranchId("a", 0)}

    asyncio.run(scenario())


def policies(interval: int) -> list[sart.Policy]:
    """One request of each kind the property tests serve."""
    return [
        sart.sart(4, interval=interval),
        sart.vanilla(),
        sart.self_consistency(3, interval=interval),
        sart.rebase(3, interval=interval),
    ]


def serve(
    engine: object,
    requests: list[sart.Request],
    script: object,
    interval: int,
    batch: int,
    token: bool,
) -> list[sart.RequestResult]:
    return sart.run(
        requests,
        engine,
        ScriptedPRM(script, every=interval),  # type: ignore[arg-type]
        batch_size=batch,
        admission=sart.Admission.TOKEN if token else sart.Admission.CHUNK,
        clock=sart.VirtualClock(),
    )


def outcomes(results: list[sart.RequestResult]) -> list[object]:
    """What the property tests compare: status, answer, each branch's status and length."""
    return [(r.status, r.answer, [(b.status, b.num_tokens) for b in r.branches]) for r in results]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    burst=st.integers(1, 12),
    interval=st.integers(1, 12),
    batch=st.integers(1, 12),
    token=st.booleans(),
)
def test_same_results_as_the_step_engine(
    seed: int, burst: int, interval: int, batch: int, token: bool
) -> None:
    # Streams run at their own pace, yet every branch advances exactly as on the
    # step-based fake: the schedule, and so every result, is the same.
    script = random_scripts(seed=seed, median_length=20, every=interval)
    requests = [
        sart.Request(f"q{i}", "p", policy, sampling=sart.SamplingSettings(max_tokens=40), arrival=i)
        for i, policy in enumerate(policies(interval))
    ]
    streamed = FakeStreamingEngine(script, burst=burst)
    assert outcomes(
        serve(SyncBridge(streamed), requests, script, interval, batch, token)
    ) == outcomes(serve(FakeEngine(script), requests, script, interval, batch, token))


class _ShutdownEngine:
    """An async engine that, like ``AsyncLLM``, leaves a task running on its loop
    and has a synchronous ``shutdown()`` (as ``VLLMAsyncEngine``)."""

    def __init__(self) -> None:
        self.closed = False
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))

    def shutdown(self) -> None:
        self.closed = True


class _AcloseEngine(_ShutdownEngine):
    """The same with an async ``aclose()`` (as ``OpenAIEngine``), preferred to shutdown."""

    async def aclose(self) -> None:
        self.closed = True

    def shutdown(self) -> None:
        raise AssertionError("aclose() is preferred")


@pytest.mark.parametrize("kind", [_ShutdownEngine, _AcloseEngine])
def test_closing_the_bridge_closes_the_engine_and_ends_every_task(kind: type) -> None:
    engine = kind()
    bridge = SyncBridge(engine)
    bridge.loop.run_until_complete(engine.start())
    with bridge:
        pass
    assert engine.closed
    assert engine.task is not None and engine.task.cancelled()
    assert bridge.loop.is_closed()
    bridge.close()  # idempotent


class _FailsToOpen(FakeStreamingEngine):
    """Refuses to open one branch (as a server refusing the request would)."""

    def __init__(self, bad: int, exc: Exception) -> None:
        super().__init__()
        self.bad, self.exc = bad, exc

    def _open(self, start: BranchStart) -> object:  # type: ignore[override]
        if start.branch.index == self.bad:
            raise self.exc
        return super()._open(start)


@pytest.mark.parametrize("exc", [RuntimeError("refused"), sart.EngineError("no", ["a"])])
def test_a_start_that_fails_midway_leaves_nothing_started(exc: Exception) -> None:
    async def scenario() -> None:
        engine = _FailsToOpen(bad=2, exc=exc)
        await engine.prefill("a", "p", sart.SamplingSettings(max_tokens=10))
        with pytest.raises(sart.EngineError) as caught:
            await engine.start_branches("a", [BranchSpec(j, j) for j in range(4)])
        assert caught.value.request_ids == frozenset({"a"})
        assert engine.stats().live_branches == 0
        engine.bad = -1  # the same branches can be started again: nothing was kept
        await engine.start_branches("a", [BranchSpec(j, j) for j in range(4)])
        assert engine.stats().live_branches == 4
        await engine.abort([BranchId("a", j) for j in range(4)])
        await engine.release_prefix("a")

    asyncio.run(scenario())


def test_the_same_branch_twice_in_one_start_is_refused_and_nothing_starts() -> None:
    # Once accepted: the second stream replaced the first in the books, whose task
    # then streamed on with nobody to abort it.
    async def scenario() -> None:
        engine = FakeStreamingEngine({"a": [BranchScript(length=30)] * 3})
        await engine.prefill("a", "p", sart.SamplingSettings(max_tokens=100))
        with pytest.raises(sart.EngineError, match=r"branches \[1\] of 'a' started twice") as info:
            await engine.start_branches("a", [BranchSpec(0, 0), BranchSpec(1, 1), BranchSpec(1, 2)])
        assert info.value.request_ids == {"a"}
        assert engine.stats().live_branches == 0
        assert asyncio.all_tasks() == {asyncio.current_task()}  # no stream was opened
        await engine.start_branches("a", [BranchSpec(j, j) for j in range(3)])  # none was kept
        out = await engine.step(100)
        assert sorted(out.deltas) == [BranchId("a", j) for j in range(3)]
        await engine.release_prefix("a")
        assert engine.stats() == sart.EngineStats(0, 0)

    asyncio.run(scenario())


# ----------------------------------------------------------------- SyncBridge loops


def test_a_bridge_on_a_borrowed_loop_leaves_it_and_its_engine_to_their_owner() -> None:
    owner = SyncBridge(FakeStreamingEngine())
    guest = SyncBridge(FakeStreamingEngine(), loop=owner.loop)
    check_engine(lambda: SyncBridge(FakeStreamingEngine(), loop=owner.loop))
    guest.close()
    assert not owner.loop.is_closed()  # still the owner's to use
    assert guest.prefill("r", "a b c", SamplingSettings(max_tokens=4)) == 3
    owner.close()
    assert owner.loop.is_closed()


def test_build_makes_the_engine_while_the_bridges_loop_runs() -> None:
    seen: list[asyncio.AbstractEventLoop] = []

    def make() -> FakeStreamingEngine:
        seen.append(asyncio.get_running_loop())  # raises unless a loop runs
        return FakeStreamingEngine()

    async def make_async() -> FakeStreamingEngine:
        return make()

    for factory in (make, make_async):
        bridge = SyncBridge.build(factory)
        assert seen[-1] is bridge.loop
        assert bridge.supports_fork  # declared by the engine, carried by the bridge
        check_engine(lambda b=bridge: SyncBridge(FakeStreamingEngine(), loop=b.loop))
        bridge.close()
        assert bridge.loop.is_closed()  # built by the bridge: its own to close


def test_a_failed_build_closes_its_loop() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    def broken() -> None:
        loops.append(asyncio.get_running_loop())
        raise RuntimeError("no engine")

    with pytest.raises(RuntimeError, match="no engine"):
        SyncBridge.build(broken)
    assert loops[0].is_closed()


def test_engines_declare_their_capabilities() -> None:
    assert isinstance(FakeEngine(), sart.ReportsUsage)
    assert isinstance(FakeStreamingEngine(), sart.AsyncEngine)
    assert not isinstance(SyncBridge(FakeStreamingEngine()), sart.ReportsUsage)


def test_a_bridge_shows_its_engines_tokenizer() -> None:
    # sart serve takes the chat template from it (SGLang runs behind a bridge).
    engine = FakeStreamingEngine(lambda branch: BranchScript(length=3))
    with SyncBridge(engine) as bridge:
        assert bridge.tokenizer is None
        engine.tokenizer = object()  # type: ignore[attr-defined]
        assert bridge.tokenizer is engine.tokenizer  # type: ignore[attr-defined]


# ---------------------------------------------------------------- per-request steps


def _per_request(script: object = None, burst: int = 5) -> FakeStreamingEngine:
    engine = FakeStreamingEngine(script, burst=burst)  # type: ignore[arg-type]
    engine.per_request_steps = True
    return engine


def test_per_request_steps_pass_the_conformance_suite() -> None:
    check_engine(lambda: SyncBridge(_per_request()))
    check_engine(lambda: SyncBridge(_per_request(burst=1)))


def test_per_request_steps_a_request_in_its_prefill_holds_no_other_back() -> None:
    async def scenario() -> None:
        engine = _per_request({"a": [BranchScript(length=6)] * 2, "b": [BranchScript(length=50)]})
        await engine.prefill("a", "p", SamplingSettings(max_tokens=100))
        await engine.prefill("b", "p", SamplingSettings(max_tokens=100))
        await engine.start_branches("a", [BranchSpec(0, 0), BranchSpec(1, 1)])
        await engine.start_branches("b", [BranchSpec(0, 0)])
        # b's stream is held at 0 tokens (a server still prefilling it): a lockstep
        # step would wait for it; here a's end is reported at once.
        engine._streams[BranchId("b", 0)].task.cancel()  # type: ignore[union-attr]
        out = await engine.step(100)
        assert out.request_steps == {"a": 6, "b": 0}
        assert out.steps == 6
        assert {bid for bid, d in out.deltas.items() if d.finish} == {
            BranchId("a", 0),
            BranchId("a", 1),
        }
        assert BranchId("b", 0) not in out.deltas  # no progress, not reported
        await engine.abort([BranchId("b", 0)])

    asyncio.run(scenario())


def test_per_request_steps_keep_a_requests_branches_in_lockstep() -> None:
    async def scenario() -> None:
        engine = _per_request({"a": [BranchScript(length=30)] * 3}, burst=9)
        await engine.prefill("a", "p", SamplingSettings(max_tokens=100))
        await engine.start_branches("a", [BranchSpec(j, j) for j in range(3)])
        out = await engine.step(7)
        assert out.request_steps == {"a": 7}
        assert {d.new_tokens for d in out.deltas.values()} == {7}
        out = await engine.step(100)  # every branch ends at token 30
        assert out.request_steps == {"a": 23}
        assert all(d.finish is FinishReason.STOP for d in out.deltas.values())

    asyncio.run(scenario())


def test_per_request_steps_cut_a_request_at_its_first_end_with_until_first_end() -> None:
    async def scenario() -> None:
        engine = _per_request({"a": [BranchScript(length=5), BranchScript(length=20)]}, burst=3)
        await engine.prefill("a", "p", SamplingSettings(max_tokens=100))
        await engine.start_branches("a", [BranchSpec(0, 0), BranchSpec(1, 1)])
        out = await engine.step(100, until_first_end=True)
        assert out.request_steps == {"a": 5}
        assert out.deltas[BranchId("a", 0)].finish is FinishReason.STOP
        assert out.deltas[BranchId("a", 1)].new_tokens == 5
        assert out.deltas[BranchId("a", 1)].finish is None

    asyncio.run(scenario())


def test_interrupt_returns_the_step_in_flight_with_what_each_request_made() -> None:
    async def scenario() -> None:
        engine = _per_request({"a": [BranchScript(length=50)]})
        await engine.prefill("a", "p", SamplingSettings(max_tokens=100))
        await engine.start_branches("a", [BranchSpec(0, 0)])
        engine._streams[BranchId("a", 0)].task.cancel()  # type: ignore[union-attr]
        step = asyncio.ensure_future(engine.step(100))
        await asyncio.sleep(0.01)
        assert not step.done()  # nothing to report: it waits
        engine.interrupt()
        out = await asyncio.wait_for(step, 1)
        assert out.steps == 0 and out.request_steps == {"a": 0} and not out.deltas
        engine.interrupt()  # with no step in flight: the next one returns at once
        out = await asyncio.wait_for(engine.step(100), 1)
        assert out.steps == 0
        await engine.abort([BranchId("a", 0)])

    asyncio.run(scenario())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    burst=st.integers(1, 12),
    interval=st.integers(1, 12),
    token=st.booleans(),
    which=st.integers(0, 3),
)
def test_per_request_steps_give_a_request_the_step_engines_result(
    seed: int, burst: int, interval: int, token: bool, which: int
) -> None:
    # A request's branches advance in lockstep and its checks come every ``interval``
    # of its own steps (request_steps): alone, it ends exactly as on the step engine.
    script = random_scripts(seed=seed, median_length=20, every=interval)
    request = sart.Request(
        "q", "p", policies(interval)[which], sampling=sart.SamplingSettings(max_tokens=40)
    )
    streamed = SyncBridge(_per_request(script, burst=burst))
    assert outcomes(serve(streamed, [request], script, interval, 8, token)) == outcomes(
        serve(FakeEngine(script), [request], script, interval, 8, token)
    )


class _Recording(FakeStreamingEngine):
    """Records each step's ``request_steps``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.per_request_steps = True
        self.advanced: list[dict[str, int]] = []

    async def step(self, max_steps: int, until_first_end: bool = False) -> sart.StepOutput:
        out = await super().step(max_steps, until_first_end)
        self.advanced.append(dict(out.request_steps or {}))
        return out


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    burst=st.integers(1, 12),
    interval=st.integers(1, 12),
    batch=st.integers(1, 12),
    token=st.booleans(),
)
def test_per_request_steps_end_every_request_once_and_leak_nothing(
    seed: int, burst: int, interval: int, batch: int, token: bool
) -> None:
    script = random_scripts(seed=seed, median_length=20, every=interval)
    requests = [
        sart.Request(f"q{i}", "p", p, sampling=sart.SamplingSettings(max_tokens=40))
        for i, p in enumerate(policies(interval) * 2)
    ]
    engine = _Recording(script, burst=burst)
    bridge = SyncBridge(engine)
    results = serve(bridge, requests, script, interval, batch, token)
    assert sorted(r.request_id for r in results) == sorted(r.id for r in requests)
    assert all(r.status is sart.RequestStatus.COMPLETED for r in results)
    assert all(b.num_tokens <= 40 for r in results for b in r.branches)
    assert bridge.stats().live_branches == 0
    assert all(set(step.values()) <= set(range(41)) for step in engine.advanced)
