"""The fake engine: scripts, truncation, misuse detection, failure injection, conformance."""

from __future__ import annotations

import pytest

import sart
from sart.engines.base import BranchSpec
from sart.testing import BranchScript, EngineMisuse, FakeEngine, check_engine, random_scripts
from sart.types import BranchId, FinishReason

SAMPLING = sart.SamplingSettings(max_tokens=10)


def started(script: dict, rid: str = "a", k: int = 2) -> FakeEngine:
    engine = FakeEngine(script)
    engine.prefill(rid, "one two", SAMPLING)
    engine.start_branches(rid, [BranchSpec(j, j) for j in range(k)])
    return engine


def test_fake_engine_passes_the_conformance_suite() -> None:
    check_engine(FakeEngine)
    check_engine(lambda: FakeEngine(random_scripts(seed=3, median_length=4)), max_tokens=5)


def test_conformance_suite_catches_a_broken_engine() -> None:
    class IgnoresMaxSteps(FakeEngine):
        def step(self, max_steps: int, until_first_end: bool = False):  # type: ignore[override]
            return super().step(max_steps + 1, until_first_end)

    with pytest.raises(AssertionError, match="engine contract"):
        check_engine(IgnoresMaxSteps)


def test_script_text_is_split_over_length_tokens() -> None:
    engine = started({"a": [BranchScript(length=4, text="abcdefgh"), BranchScript(length=20)]})
    out = engine.step(3)
    assert out.steps == 3
    assert out.deltas[BranchId("a", 0)].text == "abcdef"
    out = engine.step(3)
    delta = out.deltas[BranchId("a", 0)]
    assert (delta.text, delta.finish, delta.end_offset) == ("gh", FinishReason.STOP, 1)
    assert out.deltas[BranchId("a", 1)].finish is None


def test_step_returns_when_every_branch_ended() -> None:
    engine = started({"a": [BranchScript(length=2), BranchScript(length=5)]})
    out = engine.step(400)
    assert out.steps == 5
    assert out.deltas[BranchId("a", 1)].finish is FinishReason.STOP
    assert engine.step(10).steps == 0


def test_truncation_at_max_tokens() -> None:
    engine = started({"a": [BranchScript(length=30), BranchScript(length=10)]})
    out = engine.step(50)
    assert out.deltas[BranchId("a", 0)].finish is FinishReason.LENGTH
    assert out.deltas[BranchId("a", 0)].new_tokens == 10
    assert out.deltas[BranchId("a", 1)].finish is FinishReason.STOP


def test_misuse_is_an_assertion() -> None:
    engine = started({"a": [BranchScript(length=30)] * 2})
    engine.abort([BranchId("a", 0)])
    with pytest.raises(EngineMisuse, match="not live"):
        engine.abort([BranchId("a", 0)])
    with pytest.raises(EngineMisuse, match="started twice"):
        engine.start_branches("a", [BranchSpec(0, 0)])
    with pytest.raises(EngineMisuse, match="while branches"):
        engine.release_prefix("a")
    with pytest.raises(EngineMisuse, match="no prefix"):
        engine.start_branches("zz", [BranchSpec(0, 0)])
    with pytest.raises(EngineMisuse, match="already held"):
        engine.prefill("a", "x", SAMPLING)
    full = FakeEngine(max_branches=1)
    full.prefill("b", "x", SAMPLING)
    with pytest.raises(EngineMisuse, match="max_branches=1"):
        full.start_branches("b", [BranchSpec(0, 0), BranchSpec(1, 1)])


def test_injected_step_failure_changes_nothing() -> None:
    script = {"a": [BranchScript(length=30)] * 2}
    engine = FakeEngine(script, fail_step={BranchId("a", 1): 7})
    engine.prefill("a", "x", SAMPLING)
    engine.start_branches("a", [BranchSpec(0, 0), BranchSpec(1, 1)])
    engine.step(5)
    kv = engine.stats().kv_tokens
    with pytest.raises(sart.EngineError) as info:
        engine.step(5)
    assert info.value.request_ids == {"a"}
    assert engine.stats().kv_tokens == kv and engine.steps == 5


def test_kv_accounting_counts_the_shared_prefix_once() -> None:
    engine = started({"a": [BranchScript(length=30)] * 2})
    assert engine.stats().kv_tokens == 2
    engine.step(4)
    assert engine.stats() == sart.EngineStats(live_branches=2, kv_tokens=2 + 8)
    engine.abort([BranchId("a", 0)])
    assert engine.stats().kv_tokens == 2 + 4


def test_random_scripts_are_stable_per_branch() -> None:
    a, b = random_scripts(seed=1), random_scripts(seed=1)
    assert a(BranchId("q", 2)) == b(BranchId("q", 2))
    assert random_scripts(seed=2)(BranchId("q", 2)) != a(BranchId("q", 2))
    assert a(BranchId("q", 0)).reward_at(1, 16, final=False) == a(BranchId("q", 0)).rewards[0]


def test_script_rewards_index_by_interval() -> None:
    s = BranchScript(rewards=(0.1, 0.2, 0.3), final_reward=0.9)
    assert [s.reward_at(t, 10, False) for t in (1, 10, 11, 20, 30, 99)] == [
        0.1,
        0.1,
        0.2,
        0.2,
        0.3,
        0.3,
    ]
    assert s.reward_at(5, 10, True) == 0.9
    assert BranchScript(rewards=(0.2, 0.4)).reward_at(5, 10, True) == 0.4
    assert BranchScript().reward_at(5, 10, False) == 0.5
    with pytest.raises(sart.ConfigError, match="rewards"):
        BranchScript(rewards=(1.5,))
