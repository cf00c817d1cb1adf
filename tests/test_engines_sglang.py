"""``SGLangEngine`` against a stand-in for ``sglang.Engine`` and, opt-in, a real SGLang.

The stand-in (``sglang_standin.SGLangStandIn``) follows ``sglang.Engine``'s
signatures; it is not SGLang (see its module). The scenarios every real adapter
shares run on it in ``test_engines_scenarios.py``; this file holds the
SGLang-specific ones.

The real tests run only where ``sglang`` is importable, a CUDA GPU is present
and ``SART_SGLANG_MODEL`` names a model::

    SART_SGLANG_MODEL=/path/to/model python -m pytest tests/test_engines_sglang.py -k real
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

import sart
from adapters import PROMPTS, check_pruned, pruning_workload
from sart.engines.base import BranchSpec
from sart.engines.scripts import BranchScript, ScriptTable
from sart.engines.streaming import SyncBridge
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
        with pytest.raises(sart.MissingDependencyError, match=r"pip install 'sart\[sglang\]'"):
            importlib.import_module("sart.engines.sglang")
        with pytest.raises(sart.MissingDependencyError, match=r"sart\[sglang\]"):
            sart.load_engine("sglang")
    finally:
        forget_adapter_module()


def test_from_args_without_sglang_says_what_to_install(
    mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` now fails
    with pytest.raises(sart.MissingDependencyError, match=r"pip install 'sart\[sglang\]'"):
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


# --------------------------------------------------------------- real SGLang, opt-in

MODEL = os.environ.get("SART_SGLANG_MODEL")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


REAL = pytest.mark.skipif(
    not (MODEL and importlib.util.find_spec("sglang") is not None and _cuda()),
    reason="real SGLang: needs sglang, a CUDA GPU and SART_SGLANG_MODEL=/path/to/model",
)


@pytest.fixture(scope="module")
def real() -> Iterator[Any]:
    """One real ``sglang.Engine`` for the module, deterministic so that seeds repeat."""
    forget_adapter_module()
    from sart.engines.sglang import SGLangEngine

    engine = SGLangEngine.from_args(
        MODEL,
        enable_deterministic_inference=True,  # sampling_seed is honoured only then
        attention_backend="triton",
        max_running_requests=64,
        mem_fraction_static=0.6,
        random_seed=0,
    )
    yield engine
    engine.shutdown()


@REAL
def test_real_passes_the_conformance_suite(real: Any) -> None:
    from sart.engines.sglang import SGLangEngine

    check_engine(lambda: SGLangEngine(real.engine).bridge(), prompts=PROMPTS)


@REAL
def test_real_sart_end_to_end(real: Any) -> None:
    from sart.engines.sglang import SGLangEngine

    requests, prm = pruning_workload([PROMPTS[i % 2] for i in range(4)], every=8, max_tokens=32)
    adapter = SGLangEngine(real.engine)
    adapter.check_batch_size(16)
    bridge = adapter.bridge()
    results = sart.run(requests, bridge, prm, batch_size=16)
    check_pruned(results, max_tokens=32)
    assert bridge.stats().live_branches == 0
    manager = real.engine.tokenizer_manager
    bridge.loop.run_until_complete(asyncio.sleep(0.5))  # let SGLang confirm the aborts
    assert not [rid for rid in manager.rid_to_state if rid.startswith(adapter.rid_prefix)]
