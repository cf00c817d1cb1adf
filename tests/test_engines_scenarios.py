"""The scenarios every real engine adapter must pass, run against each of them.

The adapters: ``HFEngine`` on the demo policy (also decoding over its own buffers,
as under CUDA graphs); ``VLLMEngine`` and
``VLLMAsyncEngine`` on vLLM (where it is installed, one engine of each per
session); ``OpenAIEngine`` against a real ``vllm serve`` (also where vLLM is);
``SGLangEngine`` on its stand-in (``sglang_standin``) and on a real
``sglang.Engine``, and ``OpenAIEngine`` against a real ``sglang.launch_server``
(SGLang's CPU path, where SGLang is installed: ``sglang_cpu``; one of each per
session). Async adapters run behind ``SyncBridge``. Each ``Adapter`` below
says how to make a fresh synchronous engine over its backend, what the
backend itself says (its own greedy decode, how many requests it runs) and
which scenarios cannot apply to it (``lacks``: they are skipped with the
reason). What only one adapter does
is tested in its own file (``test_engines_<name>.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

import sart
from adapters import (
    PROMPTS,
    VLLM_ENGINE_ARGS,
    VLLM_SERVER_MAX_MODEL_LEN,
    check_pruned,
    fresh_vllm,
    fresh_vllm_async,
    pruning_workload,
    run_to_end,
    sart_requests,
    server_metric,
)
from sart.engines.base import BranchSpec, ReportsUsage, supports_fork, supports_pause
from sart.engines.scripts import BranchScript, ScriptTable
from sart.engines.sync_bridge import SyncBridge
from sart.testing import ScriptedPRM, check_engine
from sart.types import BranchId, BranchStatus, FinishReason
from sglang_cpu import NO_EOS, SGLANG_CONTEXT_LEN, sglang_adapter

GREEDY_FORKS = "greedy forks"
STOP_STRINGS = "stop strings"
GREEDY = "greedy"
CONTEXT = "context limit"
TOKEN_PROMPT_CONTEXT = "context limit on token prompts"
VOCABULARY = "vocabulary"
SEEDS = "reproducible seeds"
SAMPLING = "vLLM's sampling fields"
STEP_HOOKS = "a step engine's interrupt and watchers"
BRIDGED = (
    "an async engine, here behind a SyncBridge: a server awaits it on its own loop, where "
    "its step returns early itself (report_every, interrupt: test_engines_streaming.py)"
)


class Adapter:
    """One adapter under test, over a backend built once (see the subclasses)."""

    context_len: int | None = None
    """The context (prompt + output tokens) the backend has, checked at prefill."""
    runs_ahead: ClassVar[bool] = False
    """The backend decodes on its own between the driver's steps (a server, or an engine
    in another process): a request that must still be running when a test looks needs
    most of the context as its ``max_tokens``."""
    lacks: ClassVar[Mapping[str, str]] = {}
    """Scenarios that cannot apply to this adapter, with the reason."""

    def __init__(self, demo_models: dict[str, Path] | None = None) -> None:
        self.made: list[Any] = []
        self.vocab: int | None = None
        """The backend's vocabulary size (the demo policy's): it refuses larger ids."""
        if demo_models is not None:
            config = json.loads((demo_models["policy"] / "config.json").read_text())
            self.vocab = config["vocab_size"]

    def require(self, feature: str) -> None:
        if feature in self.lacks:
            pytest.skip(self.lacks[feature])

    def conformance_engine(self) -> Any:
        """A fresh engine for ``check_engine`` (which compares two runs of the same
        seeds): ``fresh`` where the backend reproduces seeds."""
        return self.fresh()

    def fresh(self) -> Any:
        """A new synchronous engine over the backend (kept, to close after the test)."""
        engine = self._fresh()
        self.made.append(engine)
        return engine

    def _fresh(self) -> Any:
        raise NotImplementedError

    def as_sent(self) -> Any:
        """A fresh engine whose requests carry exactly what sart sends (``fresh``, but
        where the harness adds sampling fields of its own)."""
        return self.fresh()

    def encode(self, text: str) -> list[int]:
        """The prompt's ids, as the adapter feeds them to the backend."""
        raise NotImplementedError

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """The backend's own greedy decode of ``prompt_ids``, with no sart in between."""
        raise NotImplementedError

    def backend_runs(self, n: int) -> None:
        """Check that the backend runs ``n`` requests (waiting for it where it runs on
        its own); a no-op where the backend cannot tell."""

    def after_test(self) -> None:
        """Close what ``fresh`` made; check that the backend holds no request."""
        self.made.clear()


def declared_capacity(engine: Any) -> int | None:
    """The KV capacity the adapter (behind a ``SyncBridge`` or not) declares."""
    adapter = engine.engine if isinstance(engine, SyncBridge) else engine
    return getattr(adapter, "kv_capacity", None)


class HF(Adapter):
    def __init__(self, demo_models: dict[str, Path]) -> None:
        super().__init__(demo_models)
        import torch

        from sart.engines.hf import HFEngine

        self.base = HFEngine.from_pretrained(str(demo_models["policy"]), dtype=torch.float32)
        self.context_len = self.base.context_len

    def _fresh(self) -> Any:
        return type(self.base)(self.base.model, self.base.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.base.tokenizer(text)["input_ids"])

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        import torch

        model, tokenizer = self.base.model, self.base.tokenizer
        expected = model.generate(
            torch.tensor([prompt_ids]),
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt_ids) :].tolist()
        eos = next(iter(self.base.eos_ids))
        if eos in expected:  # generate pads after EOS; the branch stops at it
            expected = expected[: expected.index(eos) + 1]
        return expected


class HFStatic(HF):
    """``HFEngine`` decoding over its own buffers, as ``cuda_graphs=True`` does on a
    GPU (here without the capture: ``sart.engines.hf_graphs``). Small column buckets:
    the scenarios cross them and grow the buffers."""

    def _fresh(self) -> Any:
        from sart.engines.hf_graphs import StaticDecode

        engine = super()._fresh()
        engine.static = StaticDecode(engine.model, capture=False, column_bucket=8)
        return engine


def greedy_params(max_tokens: int) -> Any:
    """vLLM's own ``SamplingParams`` for a greedy decode, reported once at its end."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY
    )


class VLLM(Adapter):
    context_len = VLLM_ENGINE_ARGS["max_model_len"]

    def __init__(self, engine: Any, demo_models: dict[str, Path]) -> None:
        super().__init__(demo_models)
        self.base = engine

    def _fresh(self) -> Any:
        return fresh_vllm(self.base)

    def encode(self, text: str) -> list[int]:
        return list(self.base.tokenizer.encode(text))

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        llm = self.base.llm_engine
        llm.add_request("raw-greedy", {"prompt_token_ids": prompt_ids}, greedy_params(max_tokens))
        final: list[int] = []
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    final = list(out.outputs[0].token_ids)
        return final

    def backend_runs(self, n: int) -> None:
        llm = self.base.llm_engine
        if not llm.has_unfinished_requests():
            llm.step()  # vLLM's scheduler counts the last aborts at its next step
        assert self.base.vllm_stats().running == n

    def after_test(self) -> None:
        super().after_test()
        assert not self.base.llm_engine.has_unfinished_requests(), "requests left in vLLM"


class VLLMAsync(Adapter):
    runs_ahead = True
    lacks: ClassVar[Mapping[str, str]] = {STEP_HOOKS: BRIDGED}
    context_len = VLLM_ENGINE_ARGS["max_model_len"]

    def __init__(self, bridge: Any, demo_models: dict[str, Path]) -> None:
        super().__init__(demo_models)
        self.bridge = bridge

    def _fresh(self) -> Any:
        return fresh_vllm_async(self.bridge)

    def settle(self, seconds: float = 0.0) -> None:
        """Let cancelled streams and vLLM's output handler run on the bridge's loop."""
        self.bridge.loop.run_until_complete(asyncio.sleep(seconds))

    def encode(self, text: str) -> list[int]:
        return list(self.bridge.engine.tokenizer.encode(text))

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        llm = self.bridge.engine.async_llm
        params = greedy_params(max_tokens)

        async def go() -> list[int]:
            final: list[int] = []
            async for out in llm.generate({"prompt_token_ids": prompt_ids}, params, "raw-greedy"):
                final = list(out.outputs[0].token_ids)
            return final

        return self.bridge.loop.run_until_complete(go())

    def backend_runs(self, n: int, timeout: float = 10.0) -> None:
        stats = None
        for _ in range(int(timeout / 0.02)):
            stats = self.bridge.engine.vllm_stats()
            if stats is not None and stats.running + stats.waiting == n:
                break
            self.settle(0.02)
        assert stats is not None and stats.running + stats.waiting == n
        assert self.bridge.engine.async_llm.get_num_unfinished_requests() == n

    def after_test(self) -> None:
        super().after_test()
        self.settle()
        unfinished = self.bridge.engine.async_llm.get_num_unfinished_requests()
        assert unfinished == 0, "requests left in vLLM"


class OpenAI(Adapter):
    runs_ahead = True
    lacks: ClassVar[Mapping[str, str]] = {STEP_HOOKS: BRIDGED}
    context_len = VLLM_SERVER_MAX_MODEL_LEN

    def __init__(self, url: str, demo_models: dict[str, Path]) -> None:
        super().__init__(demo_models)
        self.url = url

    def _fresh(self) -> Any:
        from sart.engines.openai import OpenAIEngine

        return SyncBridge(OpenAIEngine(self.url, "demo"))

    def encode(self, text: str) -> list[int]:
        import httpx

        body = {"model": "demo", "prompt": text}
        return httpx.post(self.url + "/tokenize", json=body, timeout=10).json()["tokens"]

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        import httpx

        body = {
            "model": "demo",
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        response = httpx.post(self.url + "/v1/completions", json=body, timeout=60)
        return response.json()["choices"][0]["token_ids"]

    def backend_runs(self, n: int) -> None:
        # The server decodes ahead of what it has streamed: only "none" is stable.
        if n == 0:
            for _ in range(100):
                if server_metric(self.url, "vllm:num_requests_running") == 0:
                    break
                time.sleep(0.05)
            assert server_metric(self.url, "vllm:num_requests_running") == 0

    def after_test(self) -> None:
        for bridge in self.made:
            bridge.close()
        super().after_test()
        self.backend_runs(0)


class SGLangOnTheStandIn(Adapter):
    context_len = 4096  # SGLangStandIn's default
    lacks: ClassVar[Mapping[str, str]] = {
        GREEDY: "the stand-in has no model: no greedy decode to compare with",
        GREEDY_FORKS: "the stand-in's tokens are a function of a request's input ids "
        "and seed: a fork does not continue as its parent does",
        STOP_STRINGS: "the stand-in does not apply stop strings",
        SAMPLING: "the stand-in has no model to sample from: it takes the fields and "
        "changes nothing",
        VOCABULARY: "the stand-in has no vocabulary",
        STEP_HOOKS: BRIDGED,
    }

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module
        self.standins: list[Any] = []

    def _fresh(self) -> Any:
        from sglang_standin import SGLangStandIn

        standin = SGLangStandIn(length=400, burst=3, delay=0.0005)
        self.standins.append(standin)
        return self.module.SGLangEngine(standin).bridge()

    def backend_runs(self, n: int) -> None:
        assert sum(len(s.running) for s in self.standins) == n

    def after_test(self) -> None:
        for bridge in self.made:
            bridge.close()
        super().after_test()
        self.backend_runs(0)
        self.standins.clear()


class SGLang(Adapter):
    """``SGLangEngine`` over the session's real ``sglang.Engine`` (SGLang's CPU path)."""

    runs_ahead = True
    context_len = SGLANG_CONTEXT_LEN
    lacks: ClassVar[Mapping[str, str]] = {
        SEEDS: "SGLang honours sampling_seed only with enable_deterministic_inference, "
        "which needs a GPU attention backend (fa3, flashinfer, triton...): SGLang's CPU "
        "path (torch_native) refuses it, so seeded branches are not reproducible there",
        STEP_HOOKS: BRIDGED,
    }

    def __init__(self, engine: Any, demo_models: dict[str, Path]) -> None:
        super().__init__(demo_models)
        self.engine = engine
        self.prefixes: list[str] = []

    def _fresh(self, greedy: bool = False) -> Any:
        # Requests ignore EOS (sglang_cpu.NO_EOS: no seeds, so no scripted lengths).
        adapter = sglang_adapter(self.engine, greedy=greedy)
        self.prefixes.append(adapter.rid_prefix)
        return adapter.bridge()

    def conformance_engine(self) -> Any:
        # Seeds do not repeat on SGLang-CPU (see lacks): check_engine's two runs are
        # compared greedily; every other rule is checked as it is.
        bridge = self._fresh(greedy=True)
        self.made.append(bridge)
        return bridge

    def as_sent(self) -> Any:
        # Without NO_EOS: SGLang ignores stop_token_ids too when ignore_eos is set.
        from sart.engines.sglang import SGLangEngine

        adapter = SGLangEngine(self.engine)
        self.prefixes.append(adapter.rid_prefix)
        bridge = adapter.bridge()
        self.made.append(bridge)
        return bridge

    def encode(self, text: str) -> list[int]:
        return list(self.engine.tokenizer_manager.tokenizer.encode(text))

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        params = {"temperature": 0.0, "max_new_tokens": max_tokens, **NO_EOS}
        out = self.engine.generate(input_ids=prompt_ids, sampling_params=params)
        return list(out["output_ids"])

    def backend_runs(self, n: int) -> None:
        from sglang_cpu import wait_for_load

        running, waiting = wait_for_load(self.engine, n)
        assert running + waiting == n, f"SGLang runs {running} and queues {waiting}, not {n}"

    def after_test(self) -> None:
        from sglang_cpu import wait_for_no_flight

        for bridge in self.made:
            bridge.close()
        super().after_test()
        self.backend_runs(0)
        held = wait_for_no_flight(self.engine)  # a step after the scheduler's load reads 0
        left = [rid for rid in held if rid.startswith(tuple(self.prefixes))]
        assert not left, f"requests left in SGLang's tokenizer manager: {left}"
        self.prefixes.clear()


class OpenAIOnSGLang(OpenAI):
    """``OpenAIEngine`` against the session's real ``python -m sglang.launch_server``,
    with the model's tokenizer, as the gateway docs ask in front of SGLang: SGLang's
    server does not check prompt ids against the vocabulary (an id outside it crashes
    its scheduler), and with the tokenizer the engine refuses them first."""

    context_len = SGLANG_CONTEXT_LEN
    lacks: ClassVar[Mapping[str, str]] = {SEEDS: SGLang.lacks[SEEDS], STEP_HOOKS: BRIDGED}

    def __init__(self, url: str, demo_models: dict[str, Path]) -> None:
        from transformers import AutoTokenizer

        super().__init__(url, demo_models)
        self.tokenizer = AutoTokenizer.from_pretrained(demo_models["policy"])

    def _fresh(self, greedy: bool = False) -> Any:
        # As in-process: requests ignore EOS; greedy is SGLang's top_k=1 (sart's own
        # temperature wins over extra_body's).
        from sart.engines.openai import OpenAIEngine

        extra = {**NO_EOS, "top_k": 1} if greedy else NO_EOS
        engine = OpenAIEngine(self.url, "demo", extra_body=extra, tokenizer=self.tokenizer)
        return SyncBridge(engine)

    def as_sent(self) -> Any:
        # Without NO_EOS: SGLang ignores stop_token_ids too when ignore_eos is set.
        from sart.engines.openai import OpenAIEngine

        bridge = SyncBridge(OpenAIEngine(self.url, "demo", tokenizer=self.tokenizer))
        self.made.append(bridge)
        return bridge

    def conformance_engine(self) -> Any:
        bridge = self._fresh(greedy=True)
        self.made.append(bridge)
        return bridge

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        import httpx

        body = {
            "model": "demo",
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            **NO_EOS,
        }
        response = httpx.post(self.url + "/v1/completions", json=body, timeout=60)
        return response.json()["choices"][0]["token_ids"]

    def backend_runs(self, n: int) -> None:
        from sglang_cpu import wait_for_server_load

        load = wait_for_server_load(self.url, n)
        assert load == n, f"SGLang's server runs or queues {load} requests, not {n}"


@pytest.fixture(
    scope="module",
    params=[
        "hf",
        "hf-static",
        "vllm",
        "vllm-async",
        "openai",
        "sglang-stand-in",
        "sglang",
        "openai-sglang",
    ],
)
def adapter(request: pytest.FixtureRequest) -> Iterator[Adapter]:
    name = request.param
    if name == "sglang-stand-in":
        from sglang_standin import adapter_module

        with adapter_module() as module:
            yield SGLangOnTheStandIn(module)
        return
    demo_models = request.getfixturevalue("demo_models")
    if name == "hf":
        yield HF(demo_models)
    elif name == "hf-static":
        yield HFStatic(demo_models)
    elif name == "vllm":
        yield VLLM(request.getfixturevalue("vllm_engine"), demo_models)
    elif name == "vllm-async":
        yield VLLMAsync(request.getfixturevalue("vllm_async_bridge"), demo_models)
    elif name == "sglang":
        yield SGLang(request.getfixturevalue("sglang_engine"), demo_models)
    elif name == "openai-sglang":
        pytest.importorskip("httpx")
        yield OpenAIOnSGLang(request.getfixturevalue("sglang_server"), demo_models)
    else:
        pytest.importorskip("httpx")
        yield OpenAI(request.getfixturevalue("vllm_server"), demo_models)


@pytest.fixture(autouse=True)
def _leaves_the_backend_empty(adapter: Adapter) -> Iterator[None]:
    yield
    adapter.after_test()


# ------------------------------------------------------------------- scenarios


def test_passes_the_conformance_suite(adapter: Adapter) -> None:
    check_engine(adapter.conformance_engine, prompts=PROMPTS)


@pytest.mark.parametrize("with_neighbours", [False, True])
def test_greedy_equals_the_backends_own_decode(adapter: Adapter, with_neighbours: bool) -> None:
    adapter.require(GREEDY)
    e = adapter.fresh()
    greedy = sart.SamplingSettings(temperature=0.0, max_tokens=24)
    n = e.prefill("a", PROMPTS[0], greedy)
    e.start_branches("a", [BranchSpec(0, 1)])
    if with_neighbours:  # batched with sampled branches of another, longer prompt
        e.prefill("b", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=30))
        e.start_branches("b", [BranchSpec(0, 5), BranchSpec(1, 6)])
    ids = run_to_end(e)[BranchId("a", 0)]
    for rid in ("a", "b") if with_neighbours else ("a",):
        e.release_prefix(rid)
    prompt = adapter.encode(PROMPTS[0])
    assert len(prompt) == n
    assert ids == adapter.greedy(prompt, 24)


def test_seeded_branches_are_reproducible_and_differ(adapter: Adapter) -> None:
    adapter.require(SEEDS)

    def sample() -> dict[BranchId, list[int]]:
        e = adapter.fresh()
        e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=12))
        e.start_branches("a", [BranchSpec(0, 100), BranchSpec(1, 101)])
        out = run_to_end(e, chunk=3)
        e.release_prefix("a")
        return out

    first, again = sample(), sample()
    assert first == again
    assert first[BranchId("a", 0)] != first[BranchId("a", 1)]


def test_abort_frees_the_branch_in_the_backend(adapter: Adapter) -> None:
    e = adapter.fresh()
    e.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=400, seed=3))
    e.start_branches("a", [BranchSpec(j, j) for j in range(3)])
    prompt_len = e.stats().kv_tokens
    out = e.step(2)
    assert all(d.new_tokens == 2 for d in out.deltas.values())
    assert e.stats().kv_tokens == prompt_len + 3 * 2
    adapter.backend_runs(3)
    e.abort([BranchId("a", 1)])
    capacity = declared_capacity(e)
    assert e.stats() == sart.EngineStats(2, prompt_len + 2 * 2, capacity)
    out = e.step(3)
    assert set(out.deltas) == {BranchId("a", 0), BranchId("a", 2)}
    assert all(d.new_tokens == 3 for d in out.deltas.values())
    adapter.backend_runs(2)  # the backend dropped it; the others go on
    e.release_prefix("a")  # aborts the other two
    assert e.stats() == sart.EngineStats(0, 0, capacity)
    adapter.backend_runs(0)


def test_an_interrupt_ends_the_step_after_its_decode_step(adapter: Adapter) -> None:
    adapter.require(STEP_HOOKS)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=40, seed=3, ignore_eos=True)

    def tokens(interrupt_at: list[int]) -> list[int]:
        e = adapter.fresh()
        e.prefill("a", PROMPTS[1], sampling)
        e.start_branches("a", [BranchSpec(0, 0)])
        made: list[int] = []
        for limit in (10, 10, 10):
            if interrupt_at and len(made) == interrupt_at[0]:
                interrupt_at.pop(0)
                e.interrupt()  # before the step: it returns after one decode step
                out = e.step(limit)
                assert out.steps == 1 and out.deltas[BranchId("a", 0)].new_tokens == 1
            else:
                out = e.step(limit)
            made += out.deltas[BranchId("a", 0)].token_ids
        e.release_prefix("a")
        return made

    # Taken once: the next step runs its whole chunk; the tokens are those of an
    # uninterrupted run, in shorter steps.
    interrupted = tokens([0, 11])
    assert len(interrupted) == 1 + 10 + 1
    assert interrupted == tokens([])[: len(interrupted)]


def test_watchers_get_each_decode_steps_tokens(adapter: Adapter) -> None:
    adapter.require(STEP_HOOKS)
    e = adapter.fresh()
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=20, seed=3, ignore_eos=True)
    pieces: list[tuple[BranchId, sart.BranchDelta]] = []
    e.watchers["a"] = lambda bid, piece: pieces.append((bid, piece))
    for rid in ("a", "b"):
        e.prefill(rid, PROMPTS[1], sampling)
        e.start_branches(rid, [BranchSpec(0, 0), BranchSpec(1, 1)])
    outs = [e.step(6), e.step(20)]  # the second runs to the end (max_tokens)
    for index in (0, 1):  # only the watched request's, a piece per step, as the step says
        bid = BranchId("a", index)
        mine = [piece for b, piece in pieces if b == bid]
        assert [p.new_tokens for p in mine] == [1] * 20 + [0]
        made = tuple(t for out in outs for t in out.deltas[bid].token_ids)
        assert tuple(t for p in mine for t in p.token_ids) == made
        assert "".join(p.text for p in mine) == "".join(out.deltas[bid].text for out in outs)
        end, last = mine[-1], outs[-1].deltas[bid]  # then its end, as the step reports it
        assert (end.finish, end.end_offset) == (last.finish, last.end_offset)
        assert end.finish is FinishReason.LENGTH
    assert {b.request_id for b, _ in pieces} == {"a"}
    e.release_prefix("a")
    e.release_prefix("b")


def test_max_tokens_truncates(adapter: Adapter) -> None:
    e = adapter.fresh()
    e.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=6, seed=3))
    e.start_branches("a", [BranchSpec(j, j) for j in range(3)])
    e.step(3)
    out = e.step(10)
    for delta in out.deltas.values():
        assert delta.finish in (FinishReason.LENGTH, FinishReason.STOP)
        if delta.finish is FinishReason.LENGTH:
            assert delta.new_tokens == 3 and delta.end_offset == 3
    e.release_prefix("a")
    assert e.stats() == sart.EngineStats(0, 0, declared_capacity(e))


def test_stop_strings_end_the_branch_and_are_cut(adapter: Adapter) -> None:
    adapter.require(STOP_STRINGS)
    e = adapter.fresh()
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=24))
    e.start_branches("a", [BranchSpec(0, 0)])
    text = "".join(d.text for _ in range(30) for d in e.step(1).deltas.values())
    e.release_prefix("a")
    assert len(text) > 6
    stop = text[3:6]
    e.prefill("b", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=24, stop=(stop,)))
    e.start_branches("b", [BranchSpec(0, 0)])
    deltas = []
    while e.stats().live_branches:
        deltas.extend(e.step(4).deltas.values())
    e.release_prefix("b")
    assert deltas[-1].finish is FinishReason.STOP
    assert "".join(d.text for d in deltas) == text[: text.index(stop)]


def test_vllms_sampling_fields_reach_the_backend(adapter: Adapter) -> None:
    # stop_token_ids, min_tokens (which holds stop tokens back) and repetition_penalty
    # change a greedy decode as vLLM defines them, on every backend.
    adapter.require(SAMPLING)

    def greedy(**fields: Any) -> tuple[list[int], FinishReason | None]:
        e = adapter.as_sent()
        sampling = sart.SamplingSettings(temperature=0.0, max_tokens=24, **fields)
        e.prefill("a", PROMPTS[0], sampling)
        e.start_branches("a", [BranchSpec(0, 1)])
        tokens: list[int] = []
        finish = None
        while e.stats().live_branches:
            for delta in e.step(5).deltas.values():
                tokens += delta.token_ids
                finish = delta.finish or finish
        e.release_prefix("a")
        return tokens, finish

    plain, _ = greedy()
    stop = plain[4]
    end = plain.index(stop) + 1
    assert greedy(stop_token_ids=[stop]) == (plain[:end], FinishReason.STOP)
    held, _ = greedy(stop_token_ids=[stop], min_tokens=end + 3)
    assert held[: end - 1] == plain[: end - 1] and len(held) >= end + 3
    assert stop not in held[: end + 3]
    penalised, _ = greedy(repetition_penalty=1.8)
    assert penalised != plain  # the demo model repeats itself within 24 tokens
    assert greedy(repetition_penalty=1.8)[0] == penalised


def test_a_fork_continues_from_its_parent(adapter: Adapter) -> None:
    adapter.require(GREEDY_FORKS)
    e = adapter.fresh()
    assert supports_fork(e)
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=10))
    e.start_branches("a", [BranchSpec(0, 0)])
    head = e.step(4).deltas[BranchId("a", 0)].token_ids
    e.start_branches("a", [BranchSpec(1, 1, parent=0)])
    if isinstance(e, ReportsUsage):
        assert e.usage("a")[0] == 2
    rest = run_to_end(e)
    e.release_prefix("a")
    # Greedy: the fork continues exactly as its parent does, within the same budget.
    assert rest[BranchId("a", 1)] == rest[BranchId("a", 0)]
    assert len(head) + len(rest[BranchId("a", 0)]) <= 10


def test_a_paused_branch_resumes_with_its_tokens(adapter: Adapter) -> None:
    adapter.require(GREEDY_FORKS)
    e = adapter.fresh()
    if not supports_pause(e):
        pytest.skip(f"{type(e).__name__} does not pause branches")
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=10))
    e.start_branches("a", [BranchSpec(0, 0), BranchSpec(1, 1)])
    head = e.step(4).deltas[BranchId("a", 0)].token_ids
    e.pause([BranchId("a", 0)])
    assert e.stats().live_branches == 1  # its KV is freed; its tokens are kept
    assert set(e.step(2).deltas) == {BranchId("a", 1)}  # the other goes on meanwhile
    e.start_branches("a", [BranchSpec(0, 0, resume=True)])
    rest = run_to_end(e)
    e.release_prefix("a")
    # Greedy: resumed from its tokens, it makes what it would have made unpaused, and no
    # more than its budget; the other branch (the same context) makes the same.
    ids = [*head, *rest[BranchId("a", 0)]]
    assert ids == adapter.greedy(adapter.encode(PROMPTS[0]), 10)
    adapter.backend_runs(0)


def test_a_branch_paused_before_its_first_token_resumes_from_the_prompt(
    adapter: Adapter,
) -> None:
    # A scheduler may pause a branch it has just started (a more urgent request
    # arrived): it holds no KV of its own, and resumed it starts from the prompt's.
    adapter.require(GREEDY_FORKS)
    e = adapter.fresh()
    if not supports_pause(e):
        pytest.skip(f"{type(e).__name__} does not pause branches")
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=10))
    e.start_branches("a", [BranchSpec(0, 0)])
    e.pause([BranchId("a", 0)])
    assert e.stats().live_branches == 0
    e.start_branches("a", [BranchSpec(0, 0, resume=True)])
    ids = run_to_end(e)[BranchId("a", 0)]
    e.release_prefix("a")
    assert ids == adapter.greedy(adapter.encode(PROMPTS[0]), 10)
    adapter.backend_runs(0)


def test_a_branch_never_paused_cannot_resume(adapter: Adapter) -> None:
    e = adapter.fresh()
    if not supports_pause(e):
        pytest.skip(f"{type(e).__name__} does not pause branches")
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=10))
    e.start_branches("a", [BranchSpec(0, 0)])
    e.step(2)
    with pytest.raises(sart.EngineError, match="not paused") as info:
        e.start_branches("a", [BranchSpec(1, 1, resume=True)])
    assert info.value.request_ids == {"a"}
    e.release_prefix("a")
    adapter.backend_runs(0)


def test_sart_end_to_end_prunes_branches_in_the_backend(adapter: Adapter) -> None:
    e = adapter.fresh()
    requests, prm = pruning_workload([PROMPTS[i % 2] for i in range(4)], every=8, max_tokens=32)
    results = sart.run(requests, e, prm, batch_size=8)
    check_pruned(results, max_tokens=32)
    assert e.stats() == sart.EngineStats(0, 0, declared_capacity(e))
    adapter.backend_runs(0)


def test_a_cancelled_request_leaves_the_backend_and_the_others_go_on(adapter: Adapter) -> None:
    e = adapter.fresh()
    driver = sart.SyncDriver(e, batch_size=8)
    # A backend that runs ahead has decoded 400 tokens within a second or two of a CI
    # machine's time, so "the other one goes on" would find it done.
    long = adapter.context_len - 256 if adapter.runs_ahead and adapter.context_len else 400
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=long, seed=3)
    for rid in ("first", "second"):
        driver.submit(sart.Request(rid, PROMPTS[1], sart.self_consistency(3, interval=4), sampling))
    while e.stats().live_branches < 6:  # both started
        assert driver.step()
    assert driver.step()  # both decoding
    assert driver.cancel("first", "client went away")
    assert driver.step()  # carries out the cancel, and nothing else
    assert e.stats().live_branches == 3
    for _ in range(2):  # the other one goes on
        assert driver.step()
    adapter.backend_runs(3)  # (vLLM counts its running requests as of its last step)
    assert driver.cancel("second")
    while driver.step():
        pass
    first, second = sorted(driver.results, key=lambda r: r.request_id)
    assert (first.status, first.reason) == (sart.RequestStatus.CANCELLED, "client went away")
    assert second.status is sart.RequestStatus.CANCELLED
    assert all(b.status is BranchStatus.FAILED for b in (*first.branches, *second.branches))
    assert max(b.num_tokens for b in first.branches) < min(b.num_tokens for b in second.branches)
    assert e.stats() == sart.EngineStats(0, 0, declared_capacity(e))
    adapter.backend_runs(0)


def test_a_failing_prm_fails_only_its_request(adapter: Adapter) -> None:
    e = adapter.fresh()
    prm = ScriptedPRM(every=4, fail_on={BranchId("q0", 1)})
    results = sart.run(sart_requests(2, max_tokens=16), e, prm, batch_size=4)
    assert [r.ok for r in results] == [False, True]
    assert all(b.status is BranchStatus.FAILED for b in results[0].branches)
    assert e.stats() == sart.EngineStats(0, 0, declared_capacity(e))


def test_rebase_forks_into_the_freed_slots(adapter: Adapter) -> None:
    e = adapter.fresh()
    table = ScriptTable({"r": [BranchScript(rewards=(r,)) for r in (0.9, 0.1, 0.1)]})
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=24, seed=11)
    (result,) = sart.run(
        [sart.Request("r", PROMPTS[1], sart.rebase(3, temperature=0.1, interval=8), sampling)],
        e,
        ScriptedPRM(table, every=8),
        batch_size=3,
    )
    assert result.ok
    assert all(b.num_tokens <= 24 and b.status.is_ended for b in result.branches)
    statuses = [b.status for b in result.branches]
    assert statuses[1:3] == [BranchStatus.PRUNED, BranchStatus.PRUNED]
    forks = result.branches[3:]
    assert forks, "branch 0 should have been forked into the freed slots"
    # A fork owns its parent's tokens (8 or more) and continues within the same max_tokens;
    # Rebase may prune forks again at later checks.
    assert all(8 < b.num_tokens for b in forks)
    assert any(b.status.is_completed for b in forks)
    assert e.stats() == sart.EngineStats(0, 0, declared_capacity(e))


@pytest.mark.parametrize("kind", ["text", "token ids"])
def test_a_prompt_too_long_fails_only_its_request(adapter: Adapter, kind: str) -> None:
    adapter.require(CONTEXT)
    if kind == "token ids":
        adapter.require(TOKEN_PROMPT_CONTEXT)
    assert adapter.context_len is not None
    # Every repetition of a prompt is at least one token.
    huge: Any = (PROMPTS[1] + " ") * adapter.context_len
    if kind == "token ids":
        huge = tuple(range(5, 300)) * (adapter.context_len // 295 + 1)
    e = adapter.fresh()
    with pytest.raises(sart.RequestRefused) as info:
        e.prefill("huge", huge, sart.SamplingSettings(max_tokens=4))
    assert info.value.request_ids == {"huge"}
    assert str(adapter.context_len) in str(info.value)  # both numbers, in the reason
    assert e.stats().kv_tokens == 0
    # Through the driver: that request fails, refused, with the reason; the other runs.
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=8)
    requests = [
        sart.Request("huge", huge, sart.self_consistency(2), sampling=sampling),
        sart.Request("fine", PROMPTS[0], sart.self_consistency(2), sampling=sampling),
    ]
    refused, fine = sart.run(requests, e, batch_size=4)
    assert (refused.refused, fine.ok) == (True, True)
    assert "leaves no room" in (refused.reason or "")
    assert e.stats() == sart.EngineStats(0, 0, declared_capacity(e))


def test_a_request_the_backend_refuses_fails_only_its_request(adapter: Adapter) -> None:
    adapter.require(VOCABULARY)
    assert adapter.vocab is not None
    e = adapter.fresh()
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=16)
    requests = [
        sart.Request("bad", (5, 6, adapter.vocab + 100), sart.sart(2, interval=4), sampling),
        sart.Request("good", PROMPTS[0], sart.sart(2, interval=4), sampling=sampling),
    ]
    results = sart.run(requests, e, ScriptedPRM(every=4), batch_size=4)
    assert [r.ok for r in results] == [False, True]
    assert results[0].refused  # a client of a server gets a 400 for it
    assert e.stats() == sart.EngineStats(0, 0, declared_capacity(e))
