"""``SimEngine``: the fake engine's scripted branches on a cost model's virtual clock.

It must pass the engine conformance suite on every preset, move its clock by
exactly what the ``CostModel`` says for each prefill and decode call, report
the preset's KV capacity, and track the peak KV-cache use of a run.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sart.engines.base import BranchSpec
from sart.engines.costs import PRESETS, CostModel
from sart.engines.fake import FakeEngine
from sart.engines.sim import SimEngine
from sart.testing import BranchScript, check_engine
from sart.types import BranchId, SamplingSettings

SAMPLING = SamplingSettings(max_tokens=1000)


def started(
    lengths: list[int], cost: str = "h100-14b", prompt_tokens: int = 10
) -> tuple[SimEngine, float]:
    """An engine holding request ``r`` with branches of these lengths, started;
    also the clock's advance for the prefill."""
    engine = SimEngine({"r": [BranchScript(length=n) for n in lengths]}, cost=cost)
    before = engine.clock.now()
    assert engine.prefill("r", (0,) * prompt_tokens, SAMPLING) == prompt_tokens
    prefill = engine.clock.now() - before
    engine.start_branches("r", [BranchSpec(j, j) for j in range(len(lengths))])
    return engine, prefill


def true_peak(prompt_tokens: int, lengths: list[int], steps: int) -> int:
    """KV tokens at the fullest moment of one decode call of ``steps`` steps from
    the start: after step ``s`` every branch still live holds ``s`` tokens (a
    branch that ends at step ``s`` frees its KV only after it)."""
    return max(prompt_tokens + s * sum(1 for n in lengths if n >= s) for s in range(steps + 1))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_passes_the_conformance_suite(name: str) -> None:
    check_engine(lambda: SimEngine(cost=name))


@pytest.mark.parametrize("name", ["h100-14b", "h200-14b", "8xh100-70b", "steps"])
def test_clock_follows_the_cost_model(name: str) -> None:
    cost = PRESETS[name]
    engine, prefill = started([3, 50], cost=name, prompt_tokens=300)
    assert prefill == pytest.approx(cost.prefill_time(300), rel=1e-12)
    if name != "steps":
        assert prefill > 0

    # First call: both branches start from the 300-token prefix; branch 0 ends after 3.
    t0 = engine.clock.now()
    out = engine.step(5)
    assert out.steps == 5
    expected = cost.decode_time([300, 300], [3, 5])
    assert engine.clock.now() - t0 == pytest.approx(expected, rel=1e-12)

    # Second call: only branch 1 is live, with 300 + 5 tokens of context.
    t1 = engine.clock.now()
    engine.step(7)
    assert engine.clock.now() - t1 == pytest.approx(cost.decode_time([305], [7]), rel=1e-12)


def test_steps_preset_counts_decode_steps() -> None:
    engine, prefill = started([4, 9], cost="steps")
    assert prefill == 0.0
    engine.step(3)
    assert engine.clock.now() == 3.0
    engine.step(10)  # returns as soon as both have ended, at step 9
    assert engine.clock.now() == 9.0


def test_a_real_preset_is_slower_with_a_longer_context() -> None:
    short, _ = started([20], prompt_tokens=10)
    long, _ = started([20], prompt_tokens=20_000)
    short.step(20)
    long.step(20)
    assert long.clock.now() > short.clock.now()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_stats_report_the_presets_capacity(name: str) -> None:
    engine = SimEngine(cost=name)
    assert engine.stats().kv_capacity == PRESETS[name].kv_capacity_tokens
    assert engine.stats().live_branches == 0


def test_stats_count_kv_like_the_fake_engine() -> None:
    engine, _ = started([4, 9], cost="steps", prompt_tokens=10)
    engine.step(3)
    stats = engine.stats()
    assert (stats.live_branches, stats.kv_tokens) == (2, 10 + 3 + 3)
    engine.step(5)  # branch 0 ended at 4 and freed its KV; branch 1 holds 8
    assert (engine.stats().live_branches, engine.stats().kv_tokens) == (1, 18)


def test_peak_kv_is_zero_before_any_decode() -> None:
    engine, _ = started([4, 9])
    assert engine.peak_kv_tokens == 0


def test_peak_kv_equal_lengths() -> None:
    # 10 prompt tokens + 3 branches x 6 tokens, all at once, just before they end.
    engine, _ = started([6, 6, 6], prompt_tokens=10)
    engine.step(10)
    assert engine.peak_kv_tokens == 28 == true_peak(10, [6, 6, 6], 10)


def test_peak_kv_over_several_calls_is_kept() -> None:
    engine, _ = started([4, 30], prompt_tokens=10)
    engine.step(4)  # 10 + 4 + 4 = 18 just before branch 0 ends
    assert engine.peak_kv_tokens == 18
    engine.step(26)  # then branch 1 grows alone to 30 tokens: 10 + 30 = 40
    assert engine.peak_kv_tokens == 40
    engine.release_prefix("r")
    assert engine.stats().kv_tokens == 0
    assert engine.peak_kv_tokens == 40  # a peak is never forgotten


def test_peak_kv_when_stopping_at_the_first_end() -> None:
    engine, _ = started([4, 30], prompt_tokens=10)
    engine.step(100, until_first_end=True)
    assert engine.peak_kv_tokens == 18 == true_peak(10, [4, 30], 4)


def test_peak_kv_when_the_longer_branch_outgrows_the_first_end() -> None:
    # 10 prompt tokens; branches of 4 and 10 tokens; one call of 10 steps. After step 4:
    # 10 + 4 + 4 = 18. After step 10: branch 0 is gone, branch 1 holds 10: 10 + 10 = 20.
    engine, _ = started([4, 10], prompt_tokens=10)
    engine.step(10)
    assert true_peak(10, [4, 10], 10) == 20
    assert engine.peak_kv_tokens == 20


@st.composite
def peak_runs(draw: st.DrawFn) -> tuple[list[int], list[int], int, list[tuple[int, bool]]]:
    """Branch lengths of request a (started at once) and b (prefilled and started once
    ``start_b`` steps have run), and the decode calls ``(max_steps, until_first_end)``."""
    lengths_a = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    lengths_b = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    start_b = draw(st.integers(0, 45))
    calls = draw(st.lists(st.tuples(st.integers(1, 15), st.booleans()), max_size=12))
    return lengths_a, lengths_b, start_b, calls


def reference_peak(
    prompts: tuple[int, int], lengths_a: list[int], lengths_b: list[int], b_at: int | None
) -> int:
    """KV at its fullest, one step at a time: after step ``t`` the prefixes held, plus
    ``t - start`` tokens for every branch that started at ``start`` and has not ended
    before ``t`` (one that ends at ``t`` still holds its KV at that moment)."""
    branches = [(0, n) for n in lengths_a]
    if b_at is not None:
        branches += [(b_at, n) for n in lengths_b]
    last = max(start + n for start, n in branches)
    peak = 0
    for t in range(1, last + 1):
        prefixes = prompts[0] + (prompts[1] if b_at is not None and b_at < t else 0)
        held = sum(t - start for start, n in branches if start < t <= start + n)
        peak = max(peak, prefixes + held)
    return peak


@settings(max_examples=200)
@given(peak_runs())
def test_peak_kv_matches_a_step_by_step_reference(
    run: tuple[list[int], list[int], int, list[tuple[int, bool]]],
) -> None:
    lengths_a, lengths_b, start_b, calls = run
    prompts = (7, 3)
    script = {
        "a": [BranchScript(length=n) for n in lengths_a],
        "b": [BranchScript(length=n) for n in lengths_b],
    }
    engine = SimEngine(script, cost="steps")
    engine.prefill("a", (0,) * prompts[0], SAMPLING)
    engine.start_branches("a", [BranchSpec(j, j) for j in range(len(lengths_a))])
    b_at: int | None = None
    calls = [*calls, *[(15, False)] * 10]  # then run everything to its end
    for max_steps, until_first_end in calls:
        if b_at is None and engine.steps >= start_b:
            b_at = engine.steps
            engine.prefill("b", (0,) * prompts[1], SAMPLING)
            engine.start_branches("b", [BranchSpec(j, j) for j in range(len(lengths_b))])
        if not engine.live_branches:
            break
        engine.step(max_steps, until_first_end=until_first_end)
    assert not engine.live_branches
    assert engine.peak_kv_tokens == reference_peak(prompts, lengths_a, lengths_b, b_at)


# ------------------------------------------------------------------ preemption


def tight(capacity: int) -> CostModel:
    """The h100-14b model with room for only ``capacity`` KV tokens."""
    return attrs.evolve(PRESETS["h100-14b"], kv_capacity_tokens=capacity)


def serve_all(engine: SimEngine, chunk: int) -> list[tuple[float, dict]]:
    """Decode every live branch to its end in calls of ``chunk`` steps: each call's
    clock time and what it reported."""
    calls = []
    while engine.stats().live_branches:
        before = engine.clock.now()
        out = engine.step(chunk)
        calls.append((engine.clock.now() - before, dict(out.deltas)))
    return calls


def run(lengths: list[int], prompt: int, cost: CostModel | str, preemption: bool, chunk: int):
    engine = SimEngine(
        {"r": [BranchScript(length=n) for n in lengths]}, cost=cost, preemption=preemption
    )
    engine.prefill("r", (0,) * prompt, SAMPLING)
    engine.start_branches("r", [BranchSpec(j, j) for j in range(len(lengths))])
    return engine, serve_all(engine, chunk)


lengths_st = st.lists(st.integers(1, 60), min_size=1, max_size=12)


@settings(max_examples=60)
@given(lengths=lengths_st, prompt=st.integers(1, 50), chunk=st.integers(1, 40))
def test_with_room_for_everything_preemption_changes_nothing(lengths, prompt, chunk) -> None:
    with_, calls = run(lengths, prompt, "h100-14b", True, chunk)
    _, without = run(lengths, prompt, "h100-14b", False, chunk)
    assert calls == without  # bit-identical times and deltas
    assert with_.preemptions == 0


@settings(max_examples=60)
@given(
    lengths=lengths_st,
    prompt=st.integers(1, 50),
    chunk=st.integers(1, 40),
    spare=st.integers(0, 80),
)
def test_a_tight_cache_preempts_but_never_overflows_or_changes_tokens(
    lengths, prompt, chunk, spare
) -> None:
    # Room for the prompt, the longest branch and then some: any single branch fits.
    capacity = prompt + max(lengths) + spare
    engine, calls = run(lengths, prompt, tight(capacity), True, chunk)
    _, ample = run(lengths, prompt, "h100-14b", True, chunk)
    assert [deltas for _, deltas in calls] == [deltas for _, deltas in ample]
    assert engine.peak_kv_tokens <= capacity
    if prompt + sum(lengths) <= capacity:
        assert engine.preemptions == 0
    # A resumed branch prefills what it had generated, never more than was made.
    assert engine.recomputed_tokens <= engine.preemptions * max(lengths)
    if engine.preemptions:
        # Recomputation and fewer branches per step cost time, never save it.
        assert sum(t for t, _ in calls) > sum(t for t, _ in ample)


def test_the_newest_branch_is_preempted_and_resumes_when_one_ends() -> None:
    # Prompt 10 and room for 35 more: the three branches need 20 + 20 + 5 = 45 at
    # their fullest, so the newest ones wait and resume as the others end.
    engine, calls = run([20, 20, 5], 10, tight(45), True, 20)
    assert engine.preemptions >= 1
    assert 0 < engine.recomputed_tokens <= 20 * engine.preemptions
    assert engine.peak_kv_tokens <= 45
    assert sum(d.new_tokens for _, deltas in calls for d in deltas.values()) == 45


def test_scripted_logprobs_are_the_fake_engines_under_preemption() -> None:
    """The simulator reports the same per-token logprobs as the fake engine; only its
    clock differs (here with a cache so small that branches are preempted)."""
    scripts = {
        "r": [
            BranchScript(
                length=50, logprobs=(-0.1, -1.5), confidences=(6.0, 0.7), logprob_every=20
            ),
            BranchScript(length=33, confidences=(2.0,)),
            BranchScript(length=70, logprobs=(-0.3,) * 3 + (-4.0,), logprob_every=10),
        ]
    }
    tight = attrs.evolve(PRESETS["h100-14b"], kv_capacity_tokens=60)
    sampling = SamplingSettings(max_tokens=64, logprobs=2)
    simulated = SimEngine(scripts, cost=tight)
    runs = []
    for engine in (FakeEngine(scripts), simulated):
        engine.prefill("r", (0,) * 10, sampling)
        engine.start_branches("r", [BranchSpec(j, j) for j in range(3)])
        outputs = [engine.step(chunk).deltas for chunk in (9, 25, 100)]
        runs.append(outputs)
    fake, sim = runs
    assert simulated.preemptions > 0
    assert fake == sim
    tokens = [t for deltas in fake for t in deltas[BranchId("r", 2)].logprobs]
    assert [t.logprob for t in tokens] == [-0.3] * 30 + [-4.0] * 34  # truncated at 64
    first = [t for deltas in fake for t in deltas[BranchId("r", 0)].logprobs]
    assert [-sum(t.top) / 2 for t in first] == [6.0] * 20 + [0.7] * 30
