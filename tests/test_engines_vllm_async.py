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
from adapters import PROMPTS, fresh_vllm_async, run_to_end
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
