"""``SGLangEngine`` against a stand-in for ``sglang.Engine`` and against a real SGLang.

The stand-in (``sglang_standin.SGLangStandIn``) follows ``sglang.Engine``'s
signatures; it is not SGLang (see its module). The ``real`` tests run SGLang
0.5.23 itself on this CPU (``sglang_cpu``: SGLang's CPU path, two stand-in
packages in ``tests/shims``), one ``sglang.Engine`` and one
``sglang.launch_server`` per session (``conftest.py``); they are skipped where
``sglang`` is not installed. The scenarios every adapter shares run on both in
``test_engines_scenarios.py``; this file holds the SGLang-specific ones::

    scripts/sglang_cpu_env.sh   # builds .ci-sglang-venv (~2 min)
    .ci-sglang-venv/bin/python -m pytest tests/test_engines_sglang.py -k real -s
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import re
import signal
import sys
import time
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import sart
from adapters import EXTRA_FIELDS, PROMPTS, check_pruned, pruning_workload, run_to_end
from sart.engines.base import BranchSpec, TokenLogprobs
from sart.engines.scripts import BranchScript, ScriptTable
from sart.engines.sync_bridge import SyncBridge
from sart.testing import ScriptedPRM, check_engine
from sart.types import BranchId, BranchStatus, FinishReason
from sglang_standin import EOS, SGLangStandIn, adapter_module, forget_adapter_module


@pytest.fixture
def mod() -> Iterator[Any]:
    """``sart.engines.sglang`` imported with the stand-in ``sglang`` module."""
    with adapter_module() as module:
        yield module


def drain(engine: Any, chunk: int = 3) -> dict[BranchId, Any]:
    """Step a bridged engine until no branch is live; the deltas summed per branch."""
    seen: dict[BranchId, dict[str, Any]] = {}
    while engine.stats().live_branches:
        for bid, d in engine.step(chunk).deltas.items():
            s = seen.setdefault(bid, {"ids": [], "text": "", "finish": None})
            s["ids"] += d.token_ids
            s["text"] += d.text
            s["finish"] = d.finish or s["finish"]
    return seen


def test_import_without_sglang_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # import and find_spec now see no sglang
    forget_adapter_module()
    try:
        with pytest.raises(sart.MissingDependencyError, match=r"pip install -e '\.\[sglang\]'"):
            importlib.import_module("sart.engines.sglang")
        with pytest.raises(sart.MissingDependencyError, match=r"'\.\[sglang\]'"):
            sart.load_engine("sglang")
    finally:
        forget_adapter_module()


def test_from_args_without_sglang_says_what_to_install(
    mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` now fails
    with pytest.raises(sart.MissingDependencyError, match=r"pip install -e '\.\[sglang\]'"):
        mod.SGLangEngine.from_args("some/model")


def test_the_registry_loads_it(mod: Any) -> None:
    assert sart.load_engine("sglang") is mod.SGLangEngine


def test_wrapping_an_engine_does_not_import_sglang(
    mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)
    engine = mod.SGLangEngine(SGLangStandIn())
    assert engine.incremental is False and engine.context_len == 4096


def test_from_args_passes_server_args_through(mod: Any) -> None:
    engine = mod.SGLangEngine.from_args(
        "org/model", tp_size=2, dp_size=2, mem_fraction_static=0.8, max_running_requests=32
    )
    args = engine.engine.server_args
    assert (args.model_path, args.tp_size, args.dp_size) == ("org/model", 2, 2)
    assert args.mem_fraction_static == 0.8
    assert engine.max_running_requests == 32
    engine.check_batch_size(32)
    with pytest.raises(sart.ConfigError, match="max_running_requests=32"):
        engine.check_batch_size(33)
    engine.shutdown()
    assert engine.engine.shut_down


def test_vllms_sampling_fields_go_to_sglang_under_its_names(mod: Any) -> None:
    sampling = sart.SamplingSettings(
        temperature=0.7,
        max_tokens=30,
        **EXTRA_FIELDS,
    )
    params = mod.SGLangEngine.sampling_params(sampling, 3, 5)  # a fork with 5 to go
    assert params == {
        "temperature": 0.7,
        "top_p": 0.95,
        "max_new_tokens": 5,
        "sampling_seed": 3,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "min_new_tokens": 5,
        "stop_token_ids": [7, 9],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    # Fields at their defaults are left to SGLang's own defaults.
    assert set(mod.SGLangEngine.sampling_params(sart.SamplingSettings(), 0, 8)) == {
        "temperature",
        "top_p",
        "max_new_tokens",
        "sampling_seed",
    }


def test_requests_carry_rid_seed_sampling_and_input_ids(mod: Any) -> None:
    standin = SGLangStandIn(length=40)
    engine = mod.SGLangEngine(standin, rid_prefix="sart-t")

    async def scenario() -> None:
        sampling = sart.SamplingSettings(temperature=0.7, top_p=0.9, max_tokens=30, stop=("##",))
        assert await engine.prefill("a", "one three five", sampling) == 4
        await engine.start_branches("a", [BranchSpec(0, 11), BranchSpec(1, 12)])
        out = await engine.step(4)
        assert set(out.deltas) == {BranchId("a", 0), BranchId("a", 1)}
        first, second = standin.calls
        assert first["rid"] == "sart-t-3:0_a" and second["rid"] == "sart-t-3:1_a"
        assert first["input_ids"] == [1, 6, 8, 7] and first["prompt"] is None
        assert first["sampling_params"] == {
            "temperature": 0.7,
            "top_p": 0.9,
            "max_new_tokens": 30,
            "sampling_seed": 11,
            "stop": ["##"],
        }
        assert second["sampling_params"]["sampling_seed"] == 12
        # A fork: prompt + the parent's tokens, max_new_tokens reduced by them.
        parent = list(out.deltas[BranchId("a", 0)].token_ids)
        await engine.start_branches("a", [BranchSpec(2, 13, parent=0)])
        await engine.step(1)
        fork = standin.calls[2]
        assert fork["rid"] == "sart-t-3:2_a"
        assert fork["input_ids"] == [1, 6, 8, 7, *parent]
        assert fork["sampling_params"]["max_new_tokens"] == 30 - len(parent)
        await engine.release_prefix("a")
        assert sorted(standin.tokenizer_manager.aborted) == [
            "sart-t-3:0_a",
            "sart-t-3:1_a",
            "sart-t-3:2_a",
        ]

    asyncio.run(scenario())


def test_rids_are_prefix_free(mod: Any) -> None:
    engine = mod.SGLangEngine(SGLangStandIn())
    rids = [engine.rid(BranchId(r, j)) for r in ("q", "q1", "1_q", "q_1") for j in (1, 11, 0)]
    assert len(set(rids)) == len(rids)
    assert not any(a != b and b.startswith(a) for a in rids for b in rids)


def test_a_resumed_branch_gets_a_new_rid(mod: Any) -> None:
    # Real SGLang aborts asynchronously: a resume under the paused stream's rid could
    # reach it first and be refused as a duplicate (seen in CI on SGLang-CPU).
    standin = SGLangStandIn(length=40)
    engine = mod.SGLangEngine(standin, rid_prefix="p")

    async def scenario() -> None:
        await engine.prefill("a", "one three five", sart.SamplingSettings(max_tokens=30))
        await engine.start_branches("a", [BranchSpec(0, 1)])
        await engine.step(2)
        for expected in ("p-5:0_a~1", "p-5:0_a~2"):
            await engine.pause([BranchId("a", 0)])
            await engine.start_branches("a", [BranchSpec(0, 1, resume=True)])
            await engine.step(1)
            assert standin.calls[-1]["rid"] == expected
        await engine.release_prefix("a")
        assert standin.tokenizer_manager.aborted == ["p-3:0_a", "p-5:0_a~1", "p-5:0_a~2"]
        assert engine.rid(BranchId("a", 0)) == "p-3:0_a"  # the request's state is gone

    asyncio.run(scenario())


def test_chat_prompts_and_token_prompts(mod: Any) -> None:
    standin = SGLangStandIn()
    chat = mod.SGLangEngine(standin, chat=True)

    async def scenario() -> None:
        sampling = sart.SamplingSettings(max_tokens=5)
        assert await chat.prefill("c", "hi there", sampling) == 5
        assert await chat.prefill("t", [5, 6, 7], sampling) == 3
        await chat.start_branches("c", [BranchSpec(0, 1)])
        await chat.start_branches("t", [BranchSpec(0, 1)])
        await chat.step(1)
        assert [c["input_ids"] for c in standin.calls] == [[1, 90, 5, 8, 91], [5, 6, 7]]
        await chat.release_prefix("c")
        await chat.release_prefix("t")

    asyncio.run(scenario())


def test_token_ids_outside_the_vocabulary_fail_their_request(mod: Any) -> None:
    # Real SGLang 0.5.23 crashes its scheduler on such ids (IndexError in the embedding).
    standin = SGLangStandIn()
    standin.tokenizer_manager.model_config = types.SimpleNamespace(vocab_size=100)  # type: ignore[attr-defined]
    engine = mod.SGLangEngine(standin)
    assert engine.vocab_size == 100

    async def scenario() -> None:
        sampling = sart.SamplingSettings(max_tokens=4)
        for bad in ([5, 100], [-1, 5]):
            with pytest.raises(sart.EngineError, match="outside the model's vocabulary") as info:
                await engine.prefill("bad", bad, sampling)
            assert info.value.request_ids == {"bad"}
        assert await engine.prefill("ok", [5, 99], sampling) == 2
        await engine.release_prefix("ok")

    asyncio.run(scenario())
    assert standin.calls == []


def test_later_branches_wait_until_the_first_has_prefilled_the_prompt(mod: Any) -> None:
    # So that SGLang's radix cache serves them the prompt (real SGLang: see
    # test_real_sart_prunes_stops_early_and_every_rid_leaves_sglang).
    standin = SGLangStandIn(length=12, delay=0.05)
    engine = mod.SGLangEngine(standin, rid_prefix="p")

    def sent() -> list[str]:
        return [call["rid"] for call in standin.calls]

    async def scenario() -> None:
        await engine.prefill("a", "x y", sart.SamplingSettings(max_tokens=30))
        await engine.start_branches("a", [BranchSpec(j, j) for j in range(3)])
        await asyncio.sleep(0.005)  # well before the first chunk (0.05 s)
        assert sent() == ["p-3:0_a"]
        await engine.step(2)
        assert sent() == ["p-3:0_a", "p-3:1_a", "p-3:2_a"]
        # Once the prompt is in, later branches and forks go at once.
        await engine.start_branches("a", [BranchSpec(3, 3), BranchSpec(4, 4, parent=0)])
        await asyncio.sleep(0.005)
        assert sent()[3:] == ["p-3:3_a", "p-3:4_a"]
        await engine.release_prefix("a")
        # A first branch aborted before its first token lets the others go.
        await engine.prefill("b", "x y", sart.SamplingSettings(max_tokens=30))
        await engine.start_branches("b", [BranchSpec(0, 0), BranchSpec(1, 1)])
        await engine.abort([BranchId("b", 0)])
        out = await engine.step(2)
        assert set(out.deltas) == {BranchId("b", 1)}
        await engine.release_prefix("b")

    asyncio.run(scenario())


def test_a_prompt_over_the_context_fails_its_request(mod: Any) -> None:
    engine = mod.SGLangEngine(SGLangStandIn(context_len=4))

    async def scenario() -> None:
        with pytest.raises(sart.EngineError, match="context length 4") as info:
            await engine.prefill("long", "a b c d e", sart.SamplingSettings(max_tokens=8))
        assert info.value.request_ids == {"long"}
        # max_new_tokens is capped by the room the prompt leaves
        await engine.prefill("ok", "a b", sart.SamplingSettings(max_tokens=8))
        await engine.start_branches("ok", [BranchSpec(0, 1)])
        await engine.step(1)
        assert engine.engine.calls[0]["sampling_params"]["max_new_tokens"] == 1
        await engine.release_prefix("ok")

    asyncio.run(scenario())


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("burst", [1, 5])
def test_both_chunk_formats_give_the_same_tokens(mod: Any, incremental: bool, burst: int) -> None:
    standin = SGLangStandIn(length=12, burst=burst, incremental=incremental)
    bridge = mod.SGLangEngine(standin).bridge()
    assert bridge.engine.incremental is incremental
    bridge.prefill("a", "p q", sart.SamplingSettings(max_tokens=20))
    bridge.start_branches("a", [BranchSpec(0, 5), BranchSpec(1, 6)])
    seen = drain(bridge)
    for j, seed in ((0, 5), (1, 6)):
        want = standin.tokens([1, 4, 4], seed)
        got = seen[BranchId("a", j)]
        assert got["ids"] == want
        assert got["text"] == "".join("" if t == EOS else f"t{t} " for t in want)
        assert got["finish"] is FinishReason.STOP
    bridge.release_prefix("a")


def deltas_of(engine: Any, chunk: int = 3) -> dict[BranchId, list[Any]]:
    """Step a bridged engine until no branch is live; each branch's deltas."""
    seen: dict[BranchId, list[Any]] = {}
    while engine.stats().live_branches:
        for bid, d in engine.step(chunk).deltas.items():
            seen.setdefault(bid, []).append(d)
    return seen


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("burst", [1, 5])
@pytest.mark.parametrize("top", [None, 0, 3])
def test_logprobs_come_one_per_token_in_both_chunk_formats(
    mod: Any, incremental: bool, burst: int, top: int | None
) -> None:
    # Bursts of 5 against steps of 3: a chunk's logprobs are split across deltas.
    standin = SGLangStandIn(length=12, burst=burst, incremental=incremental)
    bridge = mod.SGLangEngine(standin).bridge()
    bridge.prefill("a", "p q", sart.SamplingSettings(max_tokens=20, logprobs=top))
    bridge.start_branches("a", [BranchSpec(0, 5), BranchSpec(1, 6)])
    seen = deltas_of(bridge)
    for call in standin.calls:  # SGLang computes none unless asked
        want = (False, None) if top is None else (True, top)
        assert (call["return_logprob"], call["top_logprobs_num"]) == want
    for j, seed in ((0, 5), (1, 6)):
        deltas = seen[BranchId("a", j)]
        ids = [t for d in deltas for t in d.token_ids]
        assert ids == standin.tokens([1, 4, 4], seed)
        if top is None:
            assert all(d.logprobs == () for d in deltas)
            continue
        assert all(len(d.logprobs) == d.new_tokens for d in deltas)
        got = [lp for d in deltas for lp in d.logprobs]
        # The likeliest tokens' ids are the stand-in's 100 and up.
        assert got == [
            TokenLogprobs(
                standin.logprobs(t, top)[0],
                tuple(standin.logprobs(t, top)[1]),
                t,
                tuple(range(100, 100 + top)),
            )
            for t in ids
        ]
    bridge.release_prefix("a")


def test_a_fork_reports_logprobs_of_its_own_tokens_only(mod: Any) -> None:
    standin = SGLangStandIn(length=30, burst=2)
    bridge = mod.SGLangEngine(standin).bridge()
    bridge.prefill("a", "p q", sart.SamplingSettings(max_tokens=10, logprobs=2))
    bridge.start_branches("a", [BranchSpec(0, 5)])
    head = bridge.step(4).deltas[BranchId("a", 0)]
    assert len(head.logprobs) == head.new_tokens == 4
    bridge.start_branches("a", [BranchSpec(1, 9, parent=0)])
    fork = deltas_of(bridge)[BranchId("a", 1)]
    assert standin.calls[1]["return_logprob"] is True
    assert standin.calls[1]["top_logprobs_num"] == 2
    assert sum(len(d.logprobs) for d in fork) == sum(d.new_tokens for d in fork) == 10 - 4
    bridge.release_prefix("a")


def test_tokens_without_logprobs_fail_their_request(mod: Any) -> None:
    # A request that asked for logprobs gets one per token or none: SGLang sending
    # tokens without them (here: a stream that ignores return_logprob) fails it.
    meta = {"id": "x", "finish_reason": None, "prompt_tokens": 2, "completion_tokens": 1}
    chunks = [{"text": "a", "output_ids": [7], "meta_info": meta}] * 3
    bridge = mod.SGLangEngine(SGLangStandIn(scripted=chunks)).bridge()
    bridge.prefill("a", [5, 6], sart.SamplingSettings(max_tokens=10, logprobs=1))
    bridge.start_branches("a", [BranchSpec(0, 1)])
    with pytest.raises(sart.EngineError, match="log-probabilities for 0 of the 1") as info:
        bridge.step(1)
    assert info.value.request_ids == {"a"}
    bridge.abort([BranchId("a", 0)])
    bridge.release_prefix("a")


def test_text_that_comes_without_a_token_goes_with_the_next_one(mod: Any) -> None:
    # Cumulative chunks as SGLang sends them; the detokenizer may hold text back
    # (an incomplete character) and release it in a chunk with no new token.
    def meta(n: int, reason: dict | None = None) -> dict:
        return {"id": "x", "finish_reason": reason, "prompt_tokens": 2, "completion_tokens": n}

    chunks = [
        {"text": "", "output_ids": [7], "meta_info": meta(1)},
        {"text": "ab", "output_ids": [7], "meta_info": meta(1)},
        {"text": "abc", "output_ids": [7, 8], "meta_info": meta(2)},
        {"text": "abc", "output_ids": [7, 8, 2], "meta_info": meta(3, {"type": "stop"})},
    ]
    bridge = mod.SGLangEngine(SGLangStandIn(scripted=chunks)).bridge()
    bridge.prefill("a", [5, 6], sart.SamplingSettings(max_tokens=10))
    bridge.start_branches("a", [BranchSpec(0, 1)])
    seen = drain(bridge, chunk=1)[BranchId("a", 0)]
    assert seen == {"ids": [7, 8, 2], "text": "abc", "finish": FinishReason.STOP}


def test_incremental_setting_is_read_from_older_server_args(mod: Any) -> None:
    standin = SGLangStandIn()
    standin.server_args = types.SimpleNamespace(stream_output=True)
    assert mod.SGLangEngine(standin).incremental is True
    assert mod.SGLangEngine(standin, incremental=False).incremental is False


def test_finish_reasons_map_to_stop_and_length(mod: Any) -> None:
    bridge = mod.SGLangEngine(SGLangStandIn(length=10)).bridge()
    bridge.prefill("s", "p", sart.SamplingSettings(max_tokens=10))
    bridge.prefill("l", "p", sart.SamplingSettings(max_tokens=6))
    bridge.start_branches("s", [BranchSpec(0, 1)])
    bridge.start_branches("l", [BranchSpec(0, 1)])
    seen = drain(bridge)
    assert seen[BranchId("s", 0)]["finish"] is FinishReason.STOP
    assert len(seen[BranchId("s", 0)]["ids"]) == 10
    assert seen[BranchId("l", 0)]["finish"] is FinishReason.LENGTH
    assert len(seen[BranchId("l", 0)]["ids"]) == 6


def test_a_raising_stream_fails_only_its_request(mod: Any) -> None:
    standin = SGLangStandIn(length=30, fail_after={":1_a": 5})
    bridge = mod.SGLangEngine(standin).bridge()
    sampling = sart.SamplingSettings(max_tokens=30)
    bridge.prefill("a", "p", sampling)
    bridge.prefill("b", "p", sampling)
    bridge.start_branches("a", [BranchSpec(0, 1), BranchSpec(1, 2)])
    bridge.start_branches("b", [BranchSpec(0, 1)])
    with pytest.raises(sart.EngineError, match="broke") as info:
        for _ in range(20):
            bridge.step(3)
    assert info.value.request_ids == {"a"}


def test_an_sglang_abort_finish_fails_its_request_with_the_reason(mod: Any) -> None:
    standin = SGLangStandIn(length=30, abort_after={":0_a": 4})
    bridge = mod.SGLangEngine(standin).bridge()
    bridge.prefill("a", "p", sart.SamplingSettings(max_tokens=30))
    bridge.start_branches("a", [BranchSpec(0, 1)])
    with pytest.raises(sart.EngineError, match="'abort': out of memory") as info:
        for _ in range(20):
            bridge.step(3)
    assert info.value.request_ids == {"a"}


def test_passes_the_conformance_suite_on_the_stand_in(mod: Any) -> None:
    check_engine(lambda: mod.SGLangEngine(SGLangStandIn(length=6)).bridge())
    check_engine(lambda: SyncBridge(mod.SGLangEngine(SGLangStandIn(length=20, incremental=True))))


def test_bridge_borrows_the_engines_loop(mod: Any) -> None:
    loop = asyncio.new_event_loop()
    try:
        bridge = mod.SGLangEngine(SGLangStandIn(loop=loop)).bridge()
        assert bridge.loop is loop
        bridge.close()
        assert not loop.is_closed()  # it belongs to sglang.Engine
        own = mod.SGLangEngine(SGLangStandIn()).bridge()
        assert own.loop is not loop
        own.close()
        assert own.loop.is_closed()
    finally:
        loop.close()


def _pruning_workload(n: int = 3) -> tuple[list[sart.Request], ScriptedPRM]:
    return pruning_workload([f"p q{i}" for i in range(n)], every=4, max_tokens=24)


def _check_pruned(results: list[sart.RequestResult], standin: SGLangStandIn, engine: Any) -> None:
    assert all(r.ok for r in results)
    pruned = [
        BranchId(r.request_id, b.index)
        for r in results
        for b in r.branches
        if b.status is BranchStatus.PRUNED
    ]
    assert len(pruned) >= len(results)
    aborted = set(standin.tokenizer_manager.aborted)
    rids = {engine.rid(bid) for bid in pruned}
    # A pruned branch whose stream was still open aborted its rid; one whose
    # stream had already ended (sart had not read it all yet) had nothing to abort.
    assert rids <= aborted | standin.completed
    assert rids & aborted
    assert not standin.running  # nothing left streaming on the engine


def test_sart_run_aborts_pruned_branches_through_the_sync_bridge(mod: Any) -> None:
    standin = SGLangStandIn(length=400, burst=3, delay=0.0005)
    engine = mod.SGLangEngine(standin)
    requests, prm = _pruning_workload()
    results = sart.run(requests, engine.bridge(), prm, batch_size=12)
    _check_pruned(results, standin, engine)


def test_sart_run_stops_early_and_aborts_the_rest(mod: Any) -> None:
    # Branch 0 ends after 6 tokens; m=1 then stops the request and aborts the others.
    standin = SGLangStandIn(length=400, lengths={":0_r": 6}, burst=2, delay=0.0005)
    engine = mod.SGLangEngine(standin)
    table = ScriptTable({"r": [BranchScript(rewards=(0.5,))] * 4})
    request = sart.Request(
        "r",
        "p r",
        sart.sart(4, m=1, interval=4),
        sart.SamplingSettings(temperature=1.0, max_tokens=300),
    )
    (result,) = sart.run([request], SyncBridge(engine), ScriptedPRM(table, every=4), batch_size=4)
    assert result.ok and result.branches[0].status is BranchStatus.FINISHED
    assert all(b.status.is_ended for b in result.branches)
    others = {engine.rid(BranchId("r", j)) for j in (1, 2, 3)}
    assert set(standin.tokenizer_manager.aborted) == others
    assert not standin.running


def test_the_async_driver_runs_it_and_aborts_pruned_branches(mod: Any) -> None:
    standin = SGLangStandIn(length=400, burst=3, delay=0.0005, incremental=True)
    engine = mod.SGLangEngine(standin)
    requests, prm = _pruning_workload(4)

    async def scenario() -> list[sart.RequestResult]:
        return await sart.AsyncDriver(engine, prm, batch_size=16).run(requests)

    results = asyncio.run(scenario())
    _check_pruned(results, standin, engine)


# ------------------------------------------------------- the stand-in for sgl_kernel


@pytest.fixture
def sgl_kernel_shim() -> Iterator[Any]:
    """``tests/shims/sgl_kernel`` imported for one test (and forgotten after)."""
    pytest.importorskip("torch")
    from sglang_cpu import SHIMS

    before = list(sys.meta_path)
    sys.path.insert(0, str(SHIMS))
    try:
        yield importlib.import_module("sgl_kernel")
    finally:
        sys.path.remove(str(SHIMS))
        sys.meta_path[:] = before
        for name in [n for n in sys.modules if n.split(".")[0] in ("sgl_kernel", "_sart_shim")]:
            del sys.modules[name]


def test_the_sgl_kernel_stand_in_fills_the_request_to_token_table(sgl_kernel_shim: Any) -> None:
    # What SGLang's Triton kernel assign_req_to_token_pool does: request i's slice of
    # out_cache_loc (the slices in batch order) goes to its row, columns start..end.
    import torch

    table = torch.zeros((4, 8), dtype=torch.int64)
    out_cache_loc = torch.tensor([11, 12, 13, 21, 22])
    sgl_kernel_shim.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 5]), torch.tensor([4, 7]), out_cache_loc, 8
    )
    assert table[2].tolist() == [0, 11, 12, 13, 0, 0, 0, 0]
    assert table[0].tolist() == [0, 0, 0, 0, 0, 21, 22, 0]
    assert table[[1, 3]].sum() == 0


def test_every_other_sgl_kernel_name_imports_but_does_not_run(sgl_kernel_shim: Any) -> None:
    from sgl_kernel import silu_and_mul  # type: ignore[import-not-found]
    from sgl_kernel.kvcacheio import transfer_kv_all_layer  # type: ignore[import-not-found]

    for op in (silu_and_mul, transfer_kv_all_layer, sgl_kernel_shim.scalar_types.uint4b8):
        with pytest.raises(NotImplementedError, match="sart's test stand-in"):
            op()


# ------------------------------------------------------------ real SGLang, on the CPU


class Recording:
    """A real ``sglang.Engine`` as the adapter sees it, recording the last ``meta_info``
    SGLang streamed for each rid (its ``cached_tokens``: the radix cache's hits)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.meta: dict[str, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def async_generate(self, **kwargs: Any) -> AsyncIterator[dict]:
        stream = await self.engine.async_generate(**kwargs)
        rid = kwargs["rid"]

        async def recorded() -> AsyncIterator[dict]:
            try:
                async for out in stream:
                    self.meta[rid] = dict(out.get("meta_info") or {})
                    yield out
            finally:
                await stream.aclose()

        return recorded()


@pytest.fixture
def real(sglang_engine: Any) -> Iterator[Any]:
    """The session's real ``sglang.Engine``, left with no request of this test."""
    from sglang_cpu import wait_for_load, wait_for_no_flight

    forget_adapter_module()  # the adapter module, over the real sglang
    yield sglang_engine
    assert wait_for_load(sglang_engine, 0) == (0, 0), "requests left in SGLang's scheduler"
    assert not wait_for_no_flight(sglang_engine), "requests left in SGLang's tokenizer manager"


def test_real_the_adapter_reads_sglangs_settings(real: Any) -> None:
    from sart.engines.sglang import SGLangEngine
    from sglang_cpu import SGLANG_CONTEXT_LEN, SGLANG_MAX_RUNNING

    engine = SGLangEngine(real)
    assert engine.context_len == SGLANG_CONTEXT_LEN
    assert engine.max_running_requests == SGLANG_MAX_RUNNING
    assert engine.vocab_size == 415  # the demo policy's
    assert engine.incremental is False  # SGLang's default: cumulative chunks
    assert engine.bridge().loop is real.loop
    engine.check_batch_size(SGLANG_MAX_RUNNING)
    with pytest.raises(sart.ConfigError, match="max_running_requests"):
        engine.check_batch_size(SGLANG_MAX_RUNNING + 1)


def test_real_sart_prunes_stops_early_and_every_rid_leaves_sglang(real: Any) -> None:
    """SART on SGLang: the low-reward branches pruned, the requests with m=1 stopped at
    their first completion; each branch's rid gone from SGLang's tokenizer manager and
    scheduler once sart aborted it; the radix cache sharing each prompt."""
    from sglang_cpu import in_flight, sglang_adapter, wait_for_load

    recording = Recording(real)
    adapter = sglang_adapter(recording)  # no EOS: branches live until pruned or stopped
    # Prompts past SGLang's in-batch prefix-caching threshold (32 tokens, see below).
    prompts = [" ".join([PROMPTS[i % 2]] * 4) for i in range(4)]
    requests, prm = pruning_workload(prompts, every=8, max_tokens=32)
    # Early stop: m=1, and rare letters as stop strings end branches at random lengths
    # (seeds do not repeat on SGLang-CPU): the first branch to end stops the others.
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=200, stop=tuple("qzxjkv"))
    requests += [
        sart.Request(f"s{i}", PROMPTS[i % 2], sart.sart(4, m=1, interval=4), sampling)
        for i in range(3)
    ]
    bridge = adapter.bridge()
    results = sart.run(requests, bridge, prm, batch_size=28)
    check_pruned(results[:4], max_tokens=32)
    stopped = results[4:]
    assert all(r.ok and r.num_completed >= 1 for r in stopped)
    statuses = [b.status for r in stopped for b in r.branches]
    assert BranchStatus.STOPPED in statuses, statuses
    assert bridge.stats().live_branches == 0
    # Every rid of every branch, pruned, stopped or ended, has left SGLang.
    assert wait_for_load(real, 0) == (0, 0)
    assert not in_flight(real, adapter.rid_prefix)
    # The radix cache: a request's first branch prefills its prompt, the others find
    # all of it but the last token (SGLang recomputes that one) in the tree. SGLang
    # holds the others back for that only when they share 32 tokens or more
    # (IN_BATCH_PREFIX_CACHING_*_THRESHOLD); shorter prompts are prefilled per branch.
    for r, prompt in zip(results, prompts, strict=False):
        n = len(adapter.tokenizer.encode(prompt))
        assert n > 32
        meta = [recording.meta[adapter.rid(BranchId(r.request_id, b.index))] for b in r.branches]
        assert all(m["prompt_tokens"] == n for m in meta)
        hits = sorted(m["cached_tokens"] for m in meta)
        assert hits[1:] == [n - 1] * (len(hits) - 1), (r.request_id, n, hits)


def test_real_the_async_driver_runs_sart_on_sglangs_loop(real: Any) -> None:
    from sglang_cpu import sglang_adapter

    adapter = sglang_adapter(real)
    requests, prm = pruning_workload([PROMPTS[i % 2] for i in range(3)], every=8, max_tokens=32)
    driver = sart.AsyncDriver(adapter, prm, batch_size=12)
    results = real.loop.run_until_complete(driver.run(requests))
    check_pruned(results, max_tokens=32)


def test_real_an_abort_by_sglang_fails_only_its_request(real: Any) -> None:
    """SGLang ending a branch itself (here: its own abort, as its /abort_request
    endpoint would) fails that branch's request with SGLang's reason; others go on."""
    from sglang_cpu import sglang_adapter

    adapter = sglang_adapter(real)
    bridge = adapter.bridge()
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=300)
    bridge.prefill("a", PROMPTS[0], sampling)
    bridge.prefill("b", PROMPTS[1], sampling)
    bridge.start_branches("a", [BranchSpec(0, 1), BranchSpec(1, 2)])
    bridge.start_branches("b", [BranchSpec(0, 1)])
    bridge.step(2)

    async def abort() -> None:
        # On SGLang's loop, where its sockets live: called outside it, the abort looked
        # for the main thread's current loop, which earlier tests may or may not leave.
        real.tokenizer_manager.abort_request(rid=adapter.rid(BranchId("a", 1)))

    bridge.loop.run_until_complete(abort())
    with pytest.raises(sart.EngineError, match="finish_reason 'abort'") as info:
        for _ in range(100):
            bridge.step(2)
    assert info.value.request_ids == {"a"}
    bridge.release_prefix("a")
    ids = run_to_end(bridge)
    assert len(ids[BranchId("b", 0)]) > 0
    bridge.release_prefix("b")


def test_real_logprobs_come_one_per_token_scaled_by_the_temperature(real: Any) -> None:
    """``logprobs=k``: one ``TokenLogprobs`` per token, ``k`` top values highest first,
    the sampled token's no higher than the top one (equal to it when greedy); none
    when not asked; a fork's for its own tokens. SGLang's are ``log_softmax(logits /
    temperature)``: at temperature 0.5 the gaps between the first token's top values
    are twice those of the greedy request on the same prompt (temperature 0 runs
    as 1)."""
    from sglang_cpu import sglang_adapter

    adapter = sglang_adapter(real)  # no EOS: every branch makes max_tokens tokens
    bridge = adapter.bridge()
    settings = {
        "hot": sart.SamplingSettings(temperature=1.0, max_tokens=12, logprobs=3),
        "greedy": sart.SamplingSettings(temperature=0.0, max_tokens=12, logprobs=3),
        "cool": sart.SamplingSettings(temperature=0.5, max_tokens=12, logprobs=3),
        "sampled-only": sart.SamplingSettings(temperature=1.0, max_tokens=12, logprobs=0),
        "none": sart.SamplingSettings(temperature=1.0, max_tokens=12),
    }
    for rid, sampling in settings.items():
        bridge.prefill(rid, PROMPTS[0], sampling)
        bridge.start_branches(rid, [BranchSpec(0, 1)])
    seen: dict[BranchId, list[Any]] = {}
    for bid, d in bridge.step(4).deltas.items():
        seen.setdefault(bid, []).append(d)
    bridge.start_branches("hot", [BranchSpec(1, 2, parent=0)])
    for bid, ds in deltas_of(bridge).items():
        seen.setdefault(bid, []).extend(ds)
    for rid in settings:
        bridge.release_prefix(rid)

    def logprobs(rid: str, j: int = 0) -> list[TokenLogprobs]:
        deltas = seen[BranchId(rid, j)]
        assert all(len(d.logprobs) == d.new_tokens for d in deltas)
        return [lp for d in deltas for lp in d.logprobs]

    assert all(d.logprobs == () for d in seen[BranchId("none", 0)])
    assert len(logprobs("hot", 1)) == 12 - 4  # the fork's own tokens
    for rid in ("hot", "greedy", "cool"):
        for j in (0, 1) if rid == "hot" else (0,):
            lps = logprobs(rid, j)
            assert len(lps) == (12 if j == 0 else 8)
            for lp in lps:
                assert len(lp.top) == 3 and list(lp.top) == sorted(lp.top, reverse=True)
                assert lp.top[0] <= 0.0 and lp.logprob <= lp.top[0] + 1e-4
    assert all(lp.logprob == lp.top[0] for lp in logprobs("greedy"))
    # Which tokens (a server names them from the ids): greedy samples the likeliest.
    tokens = [t for d in seen[BranchId("greedy", 0)] for t in d.token_ids]
    assert [lp.token_id for lp in logprobs("greedy")] == tokens
    assert all(
        lp.token_id == lp.top_ids[0] and len(set(lp.top_ids)) == 3 for lp in logprobs("greedy")
    )
    assert all(lp.top == () and lp.logprob <= 0.0 for lp in logprobs("sampled-only"))
    greedy, cool = logprobs("greedy")[0].top, logprobs("cool")[0].top
    for a, b in ((0, 1), (1, 2)):
        assert cool[a] - cool[b] == pytest.approx(2 * (greedy[a] - greedy[b]), abs=1e-4)


def test_real_branches_sample_independently(real: Any) -> None:
    # Not reproducibly (sampling_seed needs enable_deterministic_inference, which
    # SGLang's CPU path refuses), but each branch draws its own tokens.
    from sart.engines.sglang import SGLangEngine

    bridge = SGLangEngine(real).bridge()
    bridge.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=16))
    bridge.start_branches("a", [BranchSpec(j, j) for j in range(4)])
    ids = run_to_end(bridge)
    bridge.release_prefix("a")
    assert len({tuple(v) for v in ids.values()}) == 4


def _abort_latency(left: Any, abort: Any, timeout: float) -> float:
    """Seconds from ``abort()`` until ``left()`` says SGLang has let the branch go."""
    start = time.perf_counter()
    abort()
    while not left():
        assert time.perf_counter() - start < timeout, "SGLang still runs the aborted branch"
    return time.perf_counter() - start


def test_real_abort_frees_the_branch_in_sglang_at_once(real: Any) -> None:
    """In-process: ``abort`` reaches SGLang's scheduler in milliseconds (measured: until
    the scheduler's answer removes the rid from the tokenizer manager)."""
    from sglang_cpu import in_flight, sglang_adapter, wait_for_load

    adapter = sglang_adapter(real)
    bridge = adapter.bridge()
    bridge.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=4000))
    bridge.start_branches("a", [BranchSpec(j, j) for j in range(3)])
    bridge.step(2)
    victim = adapter.rid(BranchId("a", 1))
    assert victim in in_flight(real)

    def left() -> bool:
        real.loop.run_until_complete(asyncio.sleep(0.001))  # SGLang's output loop runs here
        return victim not in in_flight(real)

    seconds = _abort_latency(left, lambda: bridge.abort([BranchId("a", 1)]), timeout=5)
    print(f"\nSGLang in-process: an aborted branch left SGLang in {seconds * 1e3:.0f} ms")
    assert seconds < 1.0
    assert sum(wait_for_load(real, 2)) <= 2
    bridge.release_prefix("a")


def test_real_a_closed_stream_frees_the_branch_on_sglangs_server(sglang_server: str) -> None:
    """Remote (``OpenAIEngine``): closing a branch's stream aborts its request on SGLang's
    server at once (measured). SGLang 0.5.23 aborts when the disconnect cancels the
    response's generator (``TokenizerManager.generate_request``); the 2 s grace of its
    ``create_abort_task`` is only a fallback."""
    from sart.engines.openai import OpenAIEngine
    from sglang_cpu import NO_EOS, server_load, wait_for_server_load

    bridge = SyncBridge(OpenAIEngine(sglang_server, "demo", extra_body=NO_EOS))
    try:
        bridge.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=4000))
        bridge.start_branches("a", [BranchSpec(j, j) for j in range(3)])
        bridge.step(2)
        assert wait_for_server_load(sglang_server, 3) == 3
        seconds = _abort_latency(
            lambda: server_load(sglang_server) <= 2,
            lambda: bridge.abort([BranchId("a", 1)]),
            timeout=10,
        )
        print(f"\nSGLang server: a closed stream's request left its scheduler in {seconds:.2f} s")
        assert seconds < 1.5
        bridge.release_prefix("a")
    finally:
        bridge.close()


def test_real_logprobs_through_sglangs_server(sglang_server: str) -> None:
    """Remote (``OpenAIEngine``): SGLang's ``/v1/completions`` returns ``logprobs=k`` one
    per token (several tokens a chunk), its ``top_logprobs`` keyed by text (it ignores
    ``return_tokens_as_token_ids``): up to ``k`` values, highest first, the sampled
    token's never above the top one and equal to it when greedy."""
    from sart.engines.openai import OpenAIEngine
    from sglang_cpu import NO_EOS

    settings = {
        "hot": sart.SamplingSettings(temperature=1.0, max_tokens=16, logprobs=3),
        "greedy": sart.SamplingSettings(temperature=0.0, max_tokens=16, logprobs=3),
        "sampled-only": sart.SamplingSettings(temperature=1.0, max_tokens=16, logprobs=0),
        "none": sart.SamplingSettings(temperature=1.0, max_tokens=16),
    }
    bridge = SyncBridge(OpenAIEngine(sglang_server, "demo", extra_body=NO_EOS))
    try:
        for rid, sampling in settings.items():
            bridge.prefill(rid, PROMPTS[1], sampling)
            bridge.start_branches(rid, [BranchSpec(0, 1)])
        seen = deltas_of(bridge)
        for rid in settings:
            bridge.release_prefix(rid)
    finally:
        bridge.close()

    def logprobs(rid: str) -> list[TokenLogprobs]:
        deltas = seen[BranchId(rid, 0)]
        assert all(len(d.logprobs) == d.new_tokens for d in deltas)
        assert sum(d.new_tokens for d in deltas) == 16
        return [lp for d in deltas for lp in d.logprobs]

    assert all(d.logprobs == () for d in seen[BranchId("none", 0)])
    for rid in ("hot", "greedy"):
        for lp in logprobs(rid):
            assert 1 <= len(lp.top) <= 3 and list(lp.top) == sorted(lp.top, reverse=True)
            assert lp.top[0] <= 0.0 and lp.logprob <= lp.top[0] + 1e-4
    assert all(lp.logprob == lp.top[0] for lp in logprobs("greedy"))
    # Keyed by text: no ids (sart serve cannot name them, docs/how-to/gateway.md).
    assert all(lp.token_id is None and lp.top_ids == () for lp in logprobs("greedy"))
    assert all(lp.top == () and lp.logprob <= 0.0 for lp in logprobs("sampled-only"))


@pytest.fixture
def sigquit_kept() -> Iterator[None]:
    """SIGQUIT's handler as it was (``from_args`` sets one while SGLang starts)."""
    saved = signal.getsignal(signal.SIGQUIT)
    yield
    signal.signal(signal.SIGQUIT, saved)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"atention_backend": "torch_native"},
            "sglang_args=atention_backend='torch_native': SGLang's ServerArgs has no field "
            "'atention_backend' (did you mean attention_backend?)",
        ),
        ({"tp": 2}, "no field 'tp' (did you mean tp_size?)"),
        (
            {"attention_backend": "torch_nativ"},
            "SGLang's attention_backend must be one of ['triton', 'torch_native'] "
            "(did you mean torch_native?)",
        ),
        ({"served_model_name": "m"}, "is not taken: sart, not SGLang, answers the API"),
    ],
)
def test_from_args_refuses_a_field_sglang_lacks_or_sart_cannot_take(
    mod: Any, sigquit_kept: None, args: dict[str, Any], message: str
) -> None:
    with pytest.raises(sart.ConfigError, match=re.escape(message)):
        mod.SGLangEngine.from_args("org/model", **args)


def test_from_args_takes_sglangs_aliases_and_json_strings(mod: Any, sigquit_kept: None) -> None:
    engine = mod.SGLangEngine.from_args(
        "org/model",
        tensor_parallel_size=2,  # SGLang's CLI alias of tp_size
        json_model_override_args={"max_position_embeddings": 2048},  # parsed by --sglang-arg
    )
    args = engine.engine.server_args
    assert args.tp_size == 2
    assert args.json_model_override_args == '{"max_position_embeddings": 2048}'


def test_a_child_that_fails_to_start_is_a_config_error_not_the_end_of_sart(
    mod: Any, sigquit_kept: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SGLang's scheduler child SIGQUITs its parent when it fails to start, and SGLang's
    # own handler then kills the whole process tree, this one included.
    class FailsToStart(SGLangStandIn):
        def __init__(self, **server_args: Any) -> None:
            signal.signal(signal.SIGQUIT, server_args["custom_sigquit_handler"])
            os.kill(os.getpid(), signal.SIGQUIT)  # what the failing child does
            time.sleep(5)  # the handler raises before this ends
            raise AssertionError("SIGQUIT was not handled")

    monkeypatch.setattr(sys.modules["sglang"], "Engine", FailsToStart)
    with pytest.raises(sart.ConfigError, match="SGLang's engine did not start: a child process"):
        mod.SGLangEngine.from_args("org/model")


def test_a_value_sglang_refuses_in_process_is_a_config_error(
    mod: Any, sigquit_kept: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Refuses(SGLangStandIn):
        def __init__(self, **server_args: Any) -> None:
            raise ValueError("Unknown dtype")

    monkeypatch.setattr(sys.modules["sglang"], "Engine", Refuses)
    with pytest.raises(sart.ConfigError, match="could not start its engine from these settings"):
        mod.SGLangEngine.from_args("org/model")


def test_sglangs_logging_setup_leaves_sarts_logging_as_it_was(
    mod: Any, sigquit_kept: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    class TakesTheLogger(SGLangStandIn):  # as SGLang's configure_logger does
        def __init__(self, **server_args: Any) -> None:
            logging.basicConfig(level=logging.ERROR, force=True)
            super().__init__(**server_args)

    root = logging.getLogger()
    handler = logging.NullHandler()
    root.addHandler(handler)
    level = root.level
    try:
        monkeypatch.setattr(sys.modules["sglang"], "Engine", TakesTheLogger)
        mod.SGLangEngine.from_args("org/model")
        assert handler in root.handlers and root.level == level
    finally:
        root.removeHandler(handler)


def test_the_cli_checks_the_branch_budget_against_max_running_requests(
    mod: Any, sigquit_kept: None
) -> None:
    from sart.builders import sglang_engine
    from sart.load_spec import LoadSpec

    spec = LoadSpec(
        engine="sglang", model="org/model", batch_size=16, sglang_args={"max_running_requests": 4}
    )
    with pytest.raises(sart.ConfigError, match="batch_size=16 must be <= SGLang's"):
        sglang_engine(spec)
    spec = LoadSpec(engine="sglang", model="org/model", sglang_args={"model_path": "other"})
    with pytest.raises(sart.ConfigError, match=r"model_path=\.\.\. is not taken: the model"):
        sglang_engine(spec)
    spec = LoadSpec(engine="sglang", model="m", sglang_args={"skip_tokenizer_init": True})
    with pytest.raises(sart.ConfigError, match="sart's commands send text prompts"):
        sglang_engine(spec)
