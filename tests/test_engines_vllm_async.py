"""The asyncio vLLM engine (``AsyncLLM``), for real, on the tiny demo model built here.

Runs where vLLM is installed and is skipped elsewhere. One ``AsyncLLM`` is
started for the module (its engine core runs in a child process) on the
event loop of one ``SyncBridge``, kept for the module: ``AsyncLLM``'s output
handler lives on that loop. Each test wraps a fresh adapter around it, on the
same loop, and leaves vLLM with no unfinished request.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sart
from sart.engines.base import BranchSpec
from sart.engines.scripts import BranchScript, ScriptTable
from sart.testing import ScriptedPRM, check_engine
from sart.types import BranchId, BranchStatus, FinishReason

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = ("Step 1: add 3 and 4.", "Step 1: add 12 and 7. Then check it: 12 + 7 =")
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; plenty for a 64-wide model
}
MAX_NUM_SEQS = 64


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A ``SyncBridge`` whose engine is a ``VLLMAsyncEngine`` built on the bridge's loop."""
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENV.items():
            mp.setenv(name, value)
        from sart.demo_models import build_demo_models
        from sart.engines.streaming import SyncBridge
        from sart.engines.vllm_async import VLLMAsyncEngine

        policy = build_demo_models(Path(tmp_path_factory.mktemp("demo")))["policy"]
        # AsyncLLM starts its output handler on the running loop: built on the bridge's.
        b = SyncBridge.build(
            lambda: VLLMAsyncEngine.from_engine_args(
                str(policy),
                dtype="float32",  # exact greedy comparisons
                block_size=32,  # vLLM-CPU needs a multiple of 32
                max_num_seqs=MAX_NUM_SEQS,
                max_model_len=1024,
                seed=0,
                enforce_eager=True,
            )
        )
        yield b
        b.close()  # shuts vLLM down and drains the loop (else exit hangs in ZeroMQ)


def settle(bridge: Any, seconds: float = 0.0) -> None:
    """Let cancelled streams and vLLM's output handler run on the bridge's loop."""
    bridge.loop.run_until_complete(asyncio.sleep(seconds))


@pytest.fixture(autouse=True)
def _leaves_vllm_empty(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "bridge" in request.fixturenames:
        b = request.getfixturevalue("bridge")
        settle(b)
        assert b.engine.async_llm.get_num_unfinished_requests() == 0, "requests left in vLLM"


def fresh(bridge: Any, **kwargs: Any) -> Any:
    """A new adapter over the module's AsyncLLM, behind a bridge on the same loop."""
    from sart.engines.streaming import SyncBridge
    from sart.engines.vllm_async import VLLMAsyncEngine

    base = bridge.engine
    engine = VLLMAsyncEngine(base.async_llm, stats_recorder=base.stats_recorder, **kwargs)
    return SyncBridge(engine, loop=bridge.loop)


def run_to_end(engine: Any, chunk: int = 5) -> dict[BranchId, list[int]]:
    ids: dict[BranchId, list[int]] = {}
    while engine.stats().live_branches:
        for bid, delta in engine.step(chunk).deltas.items():
            ids.setdefault(bid, []).extend(delta.token_ids)
    return ids


def vllm_generate(bridge: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """vLLM's own greedy generation, with no sart in between."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = bridge.engine.async_llm
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY
    )

    async def go() -> list[int]:
        final: list[int] = []
        async for out in llm.generate({"prompt_token_ids": prompt_ids}, params, "raw-greedy"):
            final = list(out.outputs[0].token_ids)
        return final

    return bridge.loop.run_until_complete(go())


def running(bridge: Any, want: int, timeout: float = 10.0) -> int:
    """vLLM's running + waiting count once it equals ``want`` (or at the timeout)."""
    stats = None
    for _ in range(int(timeout / 0.02)):
        stats = bridge.engine.vllm_stats()
        if stats is not None and stats.running + stats.waiting == want:
            break
        settle(bridge, 0.02)
    assert stats is not None
    return stats.running + stats.waiting


def test_without_vllm_the_engine_names_its_extras() -> None:
    if HAVE_VLLM:
        pytest.skip("vLLM is installed here")
    with pytest.raises(sart.MissingDependencyError, match=r"pip install 'sart\[vllm\]'"):
        sart.load_engine("vllm-async")


def test_the_registry_loads_it(bridge: Any) -> None:
    assert sart.load_engine("vllm-async") is type(bridge.engine)


def test_passes_the_conformance_suite(bridge: Any) -> None:
    check_engine(lambda: fresh(bridge), prompts=PROMPTS)


@pytest.mark.parametrize("with_neighbours", [False, True])
def test_greedy_equals_vllms_own_generate(bridge: Any, with_neighbours: bool) -> None:
    e = fresh(bridge)
    greedy = sart.SamplingSettings(temperature=0.0, max_tokens=24)
    n = e.prefill("a", PROMPTS[0], greedy)
    e.start_branches("a", [BranchSpec(0, 1)])
    if with_neighbours:  # streamed alongside sampled branches of another, longer prompt
        e.prefill("b", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=30))
        e.start_branches("b", [BranchSpec(0, 5), BranchSpec(1, 6)])
    ids = run_to_end(e)[BranchId("a", 0)]
    for rid in ("a", "b") if with_neighbours else ("a",):
        e.release_prefix(rid)
    prompt = list(e.engine.tokenizer.encode(PROMPTS[0]))
    assert len(prompt) == n
    assert ids == vllm_generate(bridge, prompt, 24)


def test_seeded_branches_are_reproducible_and_differ(bridge: Any) -> None:
    def sample() -> dict[BranchId, list[int]]:
        e = fresh(bridge)
        e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=12))
        e.start_branches("a", [BranchSpec(0, 100), BranchSpec(1, 101)])
        out = run_to_end(e, chunk=3)
        e.release_prefix("a")
        return out

    first, again = sample(), sample()
    assert first == again
    assert first[BranchId("a", 0)] != first[BranchId("a", 1)]


def test_abort_really_aborts_in_vllm(bridge: Any) -> None:
    e = fresh(bridge)
    e.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=400, seed=3))
    e.start_branches("a", [BranchSpec(j, j) for j in range(3)])
    prompt_len = e.stats().kv_tokens
    out = e.step(2)
    assert all(d.new_tokens == 2 for d in out.deltas.values())
    assert e.stats().kv_tokens == prompt_len + 3 * 2
    assert running(bridge, 3) == 3
    e.abort([BranchId("a", 1)])
    assert e.stats().live_branches == 2
    assert bridge.engine.async_llm.get_num_unfinished_requests() == 2
    assert running(bridge, 2) == 2  # vLLM's scheduler dropped it; the others go on
    out = e.step(3)
    assert set(out.deltas) == {BranchId("a", 0), BranchId("a", 2)}
    assert all(d.new_tokens == 3 for d in out.deltas.values())
    e.release_prefix("a")  # aborts the other two
    assert e.stats() == sart.EngineStats(0, 0, e.engine.kv_capacity)
    assert running(bridge, 0) == 0


def test_max_tokens_truncates(bridge: Any) -> None:
    e = fresh(bridge)
    e.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=6, seed=3))
    e.start_branches("a", [BranchSpec(j, j) for j in range(3)])
    e.step(3)
    out = e.step(10)
    for delta in out.deltas.values():
        assert delta.finish in (FinishReason.LENGTH, FinishReason.STOP)
        if delta.finish is FinishReason.LENGTH:
            assert delta.new_tokens == 3 and delta.end_offset == 3
    e.release_prefix("a")
    assert e.stats().live_branches == 0


def test_a_fork_continues_from_its_parent(bridge: Any) -> None:
    e = fresh(bridge)
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=10))
    e.start_branches("a", [BranchSpec(0, 0)])
    head = e.step(4).deltas[BranchId("a", 0)].token_ids
    e.start_branches("a", [BranchSpec(1, 1, parent=0)])
    rest = run_to_end(e)
    e.release_prefix("a")
    assert rest[BranchId("a", 1)] == rest[BranchId("a", 0)]  # greedy: same continuation
    assert len(head) + len(rest[BranchId("a", 0)]) <= 10


def test_sart_end_to_end_leaves_vllm_empty(bridge: Any) -> None:
    e = fresh(bridge)
    low, high = BranchScript(rewards=(0.1,)), BranchScript(rewards=(0.9,))
    ids = [f"q{i}" for i in range(4)]
    prm = ScriptedPRM(ScriptTable({rid: [high, high, low, low] for rid in ids}), every=8)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=32)
    requests = [
        sart.Request(rid, PROMPTS[i % 2], sart.sart(4, interval=8), sampling=sampling)
        for i, rid in enumerate(ids)
    ]
    results = sart.run(requests, e, prm, batch_size=8)
    assert all(r.ok for r in results)
    assert all(r.num_completed >= 1 for r in results)
    statuses = [b.status for r in results for b in r.branches]
    assert statuses.count(BranchStatus.PRUNED) >= 4
    assert all(s.is_ended for s in statuses)
    assert all(b.num_tokens <= 32 for r in results for b in r.branches)
    assert e.stats() == sart.EngineStats(0, 0, e.engine.kv_capacity)
    settle(bridge)
    assert bridge.engine.async_llm.get_num_unfinished_requests() == 0
    assert running(bridge, 0) == 0


def test_rebase_forks_through_the_streams(bridge: Any) -> None:
    e = fresh(bridge)
    table = ScriptTable({"r": [BranchScript(rewards=(r,)) for r in (0.9, 0.1, 0.1)]})
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=24, seed=11)
    (result,) = sart.run(
        [sart.Request("r", PROMPTS[1], sart.rebase(3, temperature=0.1, interval=8), sampling)],
        e,
        ScriptedPRM(table, every=8),
        batch_size=3,
    )
    assert result.ok
    assert result.branches[3:], "branch 0 should have been forked into the freed slots"
    assert all(8 < b.num_tokens <= 24 for b in result.branches[3:])
    assert e.stats() == sart.EngineStats(0, 0, e.engine.kv_capacity)


def test_a_request_vllm_refuses_fails_only_its_request(bridge: Any) -> None:
    e = fresh(bridge)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=16)
    vocab = len(e.engine.tokenizer)
    requests = [
        sart.Request("bad", (5, 6, vocab + 100), sart.sart(2, interval=4), sampling=sampling),
        sart.Request("good", PROMPTS[0], sart.sart(2, interval=4), sampling=sampling),
    ]
    results = sart.run(requests, e, ScriptedPRM(every=4), batch_size=4)
    assert [r.ok for r in results] == [False, True]
    assert e.stats() == sart.EngineStats(0, 0, e.engine.kv_capacity)


def test_a_stream_vllm_ends_fails_only_its_request(bridge: Any) -> None:
    e = fresh(bridge)
    e.prefill("x", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=200))
    e.start_branches("x", [BranchSpec(0, 1), BranchSpec(1, 2)])
    e.prefill("y", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=12))
    e.start_branches("y", [BranchSpec(0, 3)])
    e.step(2)
    bridge.loop.run_until_complete(bridge.engine.async_llm.abort("1_x"))  # behind sart's back
    with pytest.raises(sart.EngineError) as info:
        run_to_end(e, chunk=4)
    assert info.value.request_ids == {"x"}
    e.abort([BranchId("x", 0), BranchId("x", 1)])  # what the scheduler does next
    e.release_prefix("x")
    tokens = run_to_end(e, chunk=4)  # the other request carries on to its end
    assert 0 < len(tokens[BranchId("y", 0)]) <= 10
    e.release_prefix("y")
    assert e.stats() == sart.EngineStats(0, 0, e.engine.kv_capacity)


def test_a_prompt_too_long_fails_only_its_request(bridge: Any) -> None:
    e = fresh(bridge)
    with pytest.raises(sart.EngineError) as info:
        e.prefill("huge", tuple(range(5, 300)) * 4, sart.SamplingSettings(max_tokens=4))
    assert info.value.request_ids == {"huge"}
    assert e.stats().kv_tokens == 0
