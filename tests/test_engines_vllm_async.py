"""The asyncio vLLM engine (``AsyncLLM``), for real, on the tiny demo model built here.

Runs where vLLM is installed and is skipped elsewhere. One ``AsyncLLM`` is
started for the session (``conftest.vllm_async_bridge``; its engine core runs
in a child process) on the event loop of one ``SyncBridge``: ``AsyncLLM``'s
output handler lives on that loop. Each test wraps a fresh adapter around it,
on the same loop, and leaves vLLM with no unfinished request. The scenarios
every real adapter shares run on it in ``test_engines_scenarios.py``; this
file holds what only the ``AsyncLLM`` engine does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import sart
from adapters import PROMPTS, check_logprobs, fresh_vllm_async, greedy_fork_logprobs, run_to_end
from sart.engines.base import BranchSpec
from sart.types import BranchId


@pytest.fixture
def bridge(vllm_async_bridge: Any) -> Iterator[Any]:
    yield vllm_async_bridge
    vllm_async_bridge.loop.run_until_complete(asyncio.sleep(0))  # let cancelled streams end
    unfinished = vllm_async_bridge.engine.async_llm.get_num_unfinished_requests()
    assert unfinished == 0, "requests left in vLLM"


def test_the_registry_loads_it(bridge: Any) -> None:
    assert sart.load_engine("vllm-async") is type(bridge.engine)


def test_a_stream_vllm_ends_fails_only_its_request(bridge: Any) -> None:
    e = fresh_vllm_async(bridge)
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


def test_each_new_token_carries_the_logprobs_asked_for(bridge: Any) -> None:
    # Three requests in one batch, seeded: logprobs=None, 0 and 3.
    e = fresh_vllm_async(bridge)
    ks = {"none": None, "zero": 0, "three": 3}
    for rid, k in ks.items():
        e.prefill(rid, PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=6, logprobs=k))
        e.start_branches(rid, [BranchSpec(0, 3), BranchSpec(1, 4)])
    tokens: dict[BranchId, list[int]] = {}
    while e.stats().live_branches:
        for bid, delta in e.step(2).deltas.items():
            check_logprobs(delta, ks[bid.request_id])
            tokens.setdefault(bid, []).extend(delta.token_ids)
    for rid in ks:
        e.release_prefix(rid)
    assert tokens[BranchId("none", 0)]
    # Same seeds, same tokens: asking for logprobs does not change sampling.
    for j in range(2):
        assert tokens[BranchId("three", j)] == tokens[BranchId("none", j)]


def test_greedy_samples_the_top_logprob_and_a_fork_reports_its_own(bridge: Any) -> None:
    # The fork continues as its parent does from the same context and reports only
    # its own tokens (not the ones it inherited).
    head, logprobs = greedy_fork_logprobs(fresh_vllm_async(bridge))
    for lp in [*head.logprobs, *logprobs[0], *logprobs[1]]:
        assert lp.logprob == pytest.approx(lp.top[0], abs=1e-4)


def test_logprobs_above_vllms_max_fail_the_request_at_prefill(bridge: Any) -> None:
    e = fresh_vllm_async(bridge)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=4, logprobs=21)
    with pytest.raises(sart.EngineError, match="max_logprobs=20") as info:
        e.prefill("a", PROMPTS[0], sampling)
    assert info.value.request_ids == {"a"}
    assert e.stats().live_branches == 0


def test_its_health_check_says_when_the_engine_core_has_died(
    demo_models: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: with vLLM's engine core dead, sart serve --engine vllm-async said /health
    # 200 while every request failed. An AsyncLLM of its own: this one is killed.
    pytest.importorskip("vllm")
    import gc
    import os
    import signal

    import psutil

    from adapters import VLLM_ENGINE_ARGS, VLLM_ENV
    from sart.engines.sync_bridge import SyncBridge
    from sart.engines.vllm_async import VLLMAsyncEngine

    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    bridge = SyncBridge.build(
        lambda: VLLMAsyncEngine.from_engine_args(str(demo_models["policy"]), **VLLM_ENGINE_ARGS)
    )
    try:
        check = bridge.engine.check_health
        bridge.loop.run_until_complete(check())  # alive: returns
        cores = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        assert cores, "AsyncLLM's engine core runs in a process of its own"
        for core in cores:
            os.kill(core.pid, signal.SIGKILL)
        with pytest.raises(sart.EngineError, match=r"^vLLM's engine is not running"):
            for _ in range(100):  # vLLM notices its core's death within a moment
                bridge.loop.run_until_complete(check())
                bridge.loop.run_until_complete(asyncio.sleep(0.1))
    finally:
        bridge.close()
        del bridge, check
        gc.collect()  # its AsyncLLM's __del__ now, not at exit when vLLM's modules are gone
