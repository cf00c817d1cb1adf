"""The fake engine: scripts, truncation, misuse detection, failure injection, conformance."""

from __future__ import annotations

import re

import pytest

import sart
from sart.engines.base import BranchSpec, TokenLogprobs
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


# ------------------------------------------------------------- log-probabilities

#: Confidence drops at token 40 (segments of 8 tokens: values 0..4 cover tokens 0..39).
DROPS_AT_40 = BranchScript(
    length=60,
    logprobs=(-0.25,) * 5 + (-2.0,),
    confidences=(4.0,) * 5 + (0.5,),
    logprob_every=8,
)


def with_logprobs(script: dict, k: int | None, rid: str = "a", n: int = 1) -> FakeEngine:
    engine = FakeEngine(script)
    engine.prefill(rid, "one two", sart.SamplingSettings(max_tokens=100, logprobs=k))
    engine.start_branches(rid, [BranchSpec(j, j) for j in range(n)])
    return engine


def test_scripted_logprobs_follow_the_script_token_by_token() -> None:
    engine = with_logprobs({"a": [DROPS_AT_40]}, k=3)
    tokens = []
    for chunk in (7, 30, 100):  # calls that start and end mid-segment
        delta = engine.step(chunk).deltas[BranchId("a", 0)]
        assert len(delta.logprobs) == delta.new_tokens
        tokens += delta.logprobs
    assert len(tokens) == 60
    for i, token in enumerate(tokens):
        assert token.logprob == (-0.25 if i < 40 else -2.0), i
        assert len(token.top) == 3
        assert list(token.top) == sorted(token.top, reverse=True)  # highest first
        # DeepConf's token confidence: minus the mean of the top-k logprobs.
        assert -sum(token.top) / 3 == pytest.approx(4.0 if i < 40 else 0.5), i


def test_logprobs_zero_gives_the_sampled_token_only() -> None:
    engine = with_logprobs({"a": [DROPS_AT_40]}, k=0)
    delta = engine.step(45).deltas[BranchId("a", 0)]
    assert [t.logprob for t in delta.logprobs] == [-0.25] * 40 + [-2.0] * 5
    assert all(t.top == () for t in delta.logprobs)


def test_no_logprobs_unless_the_request_asks() -> None:
    engine = FakeEngine({"a": [DROPS_AT_40], "b": [DROPS_AT_40]})
    engine.prefill("a", "x", sart.SamplingSettings(max_tokens=100))
    engine.prefill("b", "x", sart.SamplingSettings(max_tokens=100, logprobs=1))
    engine.start_branches("a", [BranchSpec(0, 0)])
    engine.start_branches("b", [BranchSpec(0, 0)])
    out = engine.step(50)
    assert out.deltas[BranchId("a", 0)].logprobs == ()
    assert len(out.deltas[BranchId("b", 0)].logprobs) == 50


def test_unscripted_logprobs_default_to_zero() -> None:
    engine = with_logprobs({"a": [BranchScript(length=5)]}, k=2)
    delta = engine.step(10).deltas[BranchId("a", 0)]
    assert delta.logprobs == (TokenLogprobs(0.0, (0.0, 0.0)),) * 5


def test_logprobs_stop_with_the_branch_at_max_tokens() -> None:
    engine = FakeEngine({"a": [DROPS_AT_40]})
    engine.prefill("a", "x", sart.SamplingSettings(max_tokens=42, logprobs=1))
    engine.start_branches("a", [BranchSpec(0, 0)])
    delta = engine.step(100).deltas[BranchId("a", 0)]
    assert delta.finish is FinishReason.LENGTH
    assert [t.logprob for t in delta.logprobs] == [-0.25] * 40 + [-2.0] * 2


def test_a_fork_continues_its_parents_position_in_the_script() -> None:
    engine = with_logprobs({"a": [DROPS_AT_40]}, k=1)
    engine.step(36)
    engine.start_branches("a", [BranchSpec(1, 1, parent=0)])
    out = engine.step(8)  # tokens 36..43 for both
    for j in (0, 1):
        assert [t.logprob for t in out.deltas[BranchId("a", j)].logprobs] == [-0.25] * 4 + [
            -2.0
        ] * 4


def test_scripted_logprobs_are_validated() -> None:
    for fields, words in [
        ({"logprobs": (-1.0, 0.5)}, "logprobs[1]=0.5 must be a finite number <= 0"),
        ({"logprobs": (float("nan"),)}, "logprobs[0]=nan"),
        ({"logprobs": (float("-inf"),)}, "logprobs[0]=-inf"),
        ({"confidences": (-0.1,)}, "confidences[0]=-0.1 must be a finite number >= 0"),
        ({"confidences": (float("inf"),)}, "confidences[0]=inf"),
        ({"confidences": 3.0}, "confidences=3.0 must be a sequence of numbers"),
        ({"logprobs": ("x",)}, "logprobs[0]='x'"),
        ({"logprob_every": 0}, "logprob_every=0 must be >= 1"),
    ]:
        with pytest.raises(sart.ConfigError, match=re.escape(words)):
            BranchScript(**fields)  # type: ignore[arg-type]
    # Sequences of ints are stored as tuples of floats.
    assert BranchScript(logprobs=[-1, 0], confidences=[2]).logprobs == (-1.0, 0.0)


def test_script_logprob_lookups_by_position() -> None:
    s = DROPS_AT_40
    assert [s.logprob_at(i) for i in (0, 39, 40, 999)] == [-0.25, -0.25, -2.0, -2.0]
    assert [s.confidence_at(i) for i in (0, 39, 40, 999)] == [4.0, 4.0, 0.5, 0.5]
    assert BranchScript().logprob_at(5) == BranchScript().confidence_at(5) == 0.0
    # A long tail costs one fill: every token past the script shares one object.
    span = s.logprobs_span(0, 16_000, 2)
    assert len(span) == 16_000 and len({id(t) for t in span}) == 6
