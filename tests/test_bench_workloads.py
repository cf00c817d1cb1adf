"""Generative workloads (``sart.bench.workloads``): the documented model, checked statistically.

Every statistical bound below was chosen from a measurement on the fixed seeds
used here, with a wide margin; generation is deterministic per seed, so
these tests cannot flake.
"""

from __future__ import annotations

import itertools
import math
import statistics

import attrs
import pytest

from sart.bench.traces import Trace, TraceRequest
from sart.bench.workloads import GAOKAO, GPQA, WORKLOADS, WorkloadModel, workload
from sart.engines.scripts import BranchScript
from sart.errors import ConfigError, UnknownComponentError
from sart.rollouts import rollout_shape, trace_rollouts

PRESETS = sorted(WORKLOADS)


def branches(trace: Trace) -> list[tuple[TraceRequest, BranchScript]]:
    return [(r, b) for r in trace for b in r.branches]


def is_correct(request: TraceRequest, b: BranchScript) -> bool:
    return b.answer == request.answer


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / ((a + b) / 2)


@pytest.fixture(scope="module", params=PRESETS)
def big(request: pytest.FixtureRequest) -> tuple[WorkloadModel, Trace]:
    """300 requests x 16 branches of one preset (about 0.1 s to generate)."""
    model = workload(request.param)
    return model, model.generate(300, 1.0, 16, 400, seed=0)


# ------------------------------------------------------------------ determinism


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = GAOKAO.generate(8, 1.0, 4, 400, seed=1)
    assert GAOKAO.generate(8, 1.0, 4, 400, seed=1) == a
    other = GAOKAO.generate(8, 1.0, 4, 400, seed=2)
    assert [r.arrival for r in other] != [r.arrival for r in a]
    assert [b.length for _, b in branches(other)] != [b.length for _, b in branches(a)]


def test_request_ids_and_trace_metadata() -> None:
    trace = GPQA.generate(6, 4.0, 3, 200, seed=0)
    assert [r.id for r in trace] == [f"r{i}" for i in range(6)]
    assert trace.width == 3
    assert trace.interval == 200
    assert all(r.prompt_tokens == GPQA.prompt_tokens for r in trace)


# ------------------------------------------------------------------ arrivals


@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_poisson_arrivals(rate: float) -> None:
    trace = GAOKAO.generate(2000, rate, 1, 400, seed=0)
    arrivals = [r.arrival for r in trace]
    assert arrivals[0] > 0
    assert all(a <= b for a, b in itertools.pairwise(arrivals))
    # Mean inter-arrival time 1/rate; measured within 4% over seeds 0-4 and three
    # rates (the standard error of the mean of 2000 exponentials is 2.2%).
    mean_gap = arrivals[-1] / len(arrivals)
    assert mean_gap == pytest.approx(1 / rate, rel=0.10)
    # Exponential gaps: their standard deviation equals their mean.
    gaps = [b - a for a, b in itertools.pairwise([0.0, *arrivals])]
    assert statistics.stdev(gaps) == pytest.approx(mean_gap, rel=0.15)


# ------------------------------------------------------------------ branches


def test_lengths_are_positive_and_rarely_truncated(big: tuple[WorkloadModel, Trace]) -> None:
    model, trace = big
    lengths = [b.length for _, b in branches(trace)]
    assert min(lengths) >= 1
    over = sum(n > model.max_tokens for n in lengths) / len(lengths)
    # Measured: 3.1% (gaokao) and 5.6% (gpqa) of 4,800 branches, loops included.
    assert 0.01 < over < 0.10


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_presets_have_the_shape_of_real_rollouts(name: str, seed: int) -> None:
    # 200 questions x 8 rollouts, as `sart bench` draws them: length CV, longest /
    # shortest, length-correctness r, correct / wrong length and the share of loops
    # all fall in the ranges measured on real reasoning rollouts (sart.rollouts).
    model = workload(name)
    trace = model.generate(200, 1.0, 8, 400, seed=seed)
    shape = rollout_shape(trace_rollouts(trace, model.max_tokens))
    assert shape.misfits() == []
    assert shape.negative_r_share > 0.6  # wrong rollouts the longer in most questions


def test_loops_and_long_tails_are_cut_at_the_cap_without_an_answer(
    big: tuple[WorkloadModel, Trace],
) -> None:
    model, trace = big
    loops = [(r, b) for r, b in branches(trace) if b.answer == ""]
    assert loops, "the presets loop now and then"
    assert all(b.length == model.max_tokens + 1 for _, b in loops)
    # Without loops, only the lognormal tail reaches the cap.
    none = attrs.evolve(model, loop_share=0.0).generate(300, 1.0, 16, 400, seed=0)
    cut = [b for _, b in branches(none) if not b.answer]
    assert len(cut) < len(loops)
    assert all(b.length == model.max_tokens + 1 for b in cut)


def test_one_reward_per_interval_until_the_end(big: tuple[WorkloadModel, Trace]) -> None:
    model, trace = big
    interval = trace.interval
    assert interval == 400
    for _, b in branches(trace):
        assert len(b.rewards) == math.ceil(min(b.length, model.max_tokens) / interval)
        assert all(0.0 <= r <= 1.0 for r in b.rewards)
        assert b.final_reward is not None and 0.0 <= b.final_reward <= 1.0


def test_reward_count_follows_the_interval() -> None:
    for interval in (100, 1000):
        trace = GAOKAO.generate(3, 1.0, 2, interval, seed=0)
        assert trace.interval == interval
        for _, b in branches(trace):
            assert len(b.rewards) == math.ceil(min(b.length, GAOKAO.max_tokens) / interval)


def test_accuracy_is_near_the_presets(big: tuple[WorkloadModel, Trace]) -> None:
    model, trace = big
    pairs = branches(trace)
    accuracy = sum(is_correct(r, b) for r, b in pairs) / len(pairs)
    # Measured 0.71 (gaokao, target 0.7) and 0.54 (gpqa, target 0.55).
    assert accuracy == pytest.approx(model.accuracy, abs=0.08)


def test_wrong_branches_run_longer_within_a_request(big: tuple[WorkloadModel, Trace]) -> None:
    # Over-thinking (Observation 1). Lengths are compared relative to their request's
    # geometric mean, because across requests hard ones think longer *and* fail more.
    _, trace = big
    correct, wrong = [], []
    for r in trace:
        centre = math.exp(statistics.mean(math.log(b.length) for b in r.branches))
        for b in r.branches:
            (correct if is_correct(r, b) else wrong).append(b.length / centre)
    assert len(correct) > 1000 and len(wrong) > 1000
    # Measured: wrong 1.25x (gaokao) and 1.10x (gpqa) longer on average (loops included);
    # 1.07x and 1.05x at the medians.
    assert statistics.mean(wrong) > 1.05 * statistics.mean(correct)
    assert statistics.median(wrong) > 1.03 * statistics.median(correct)


def test_harder_requests_think_longer(big: tuple[WorkloadModel, Trace]) -> None:
    # Pooled over requests, wrong branches are longer (measured 13-17%), because a
    # request's median length grows with its difficulty.
    _, trace = big
    correct = [b.length for r, b in branches(trace) if is_correct(r, b)]
    wrong = [b.length for r, b in branches(trace) if not is_correct(r, b)]
    assert statistics.mean(wrong) > 1.05 * statistics.mean(correct)


@pytest.mark.parametrize("name", PRESETS)
def test_without_the_difficulty_term_lengths_do_not_depend_on_correctness(name: str) -> None:
    flat = attrs.evolve(workload(name), difficulty_length=0.0, overthink=0.0, loop_share=0.0)
    trace = flat.generate(300, 1.0, 16, 400, seed=0)
    correct = [b.length for r, b in branches(trace) if is_correct(r, b)]
    wrong = [b.length for r, b in branches(trace) if not is_correct(r, b)]
    # Measured at most 3.4% over seeds 0-3 (request medians still vary: noisy).
    assert relative_difference(statistics.mean(correct), statistics.mean(wrong)) < 0.10


def test_the_prm_prefers_correct_branches(big: tuple[WorkloadModel, Trace]) -> None:
    _, trace = big
    correct = [b.final_reward for r, b in branches(trace) if is_correct(r, b)]
    wrong = [b.final_reward for r, b in branches(trace) if not is_correct(r, b)]
    # Measured means: 0.67 vs 0.48 (gaokao), 0.65 vs 0.44 (gpqa).
    assert statistics.mean(correct) > statistics.mean(wrong) + 0.1
    # The last step reward of a long branch is informative as well.
    late_c = [b.rewards[-1] for r, b in branches(trace) if is_correct(r, b) and len(b.rewards) > 8]
    late_w = [
        b.rewards[-1] for r, b in branches(trace) if not is_correct(r, b) and len(b.rewards) > 8
    ]
    assert statistics.mean(late_c) > statistics.mean(late_w)


def test_wrong_answers_spread_over_several_values(big: tuple[WorkloadModel, Trace]) -> None:
    model, trace = big
    # Loops (no answer, "") aside.
    distinct = [len({b.answer for b in r.branches if not is_correct(r, b)} - {""}) for r in trace]
    assert max(distinct) <= model.wrong_answers
    # Measured: 250 (gaokao) and 302 (gpqa) of 300 requests have two or more.
    assert sum(d >= 2 for d in distinct) > len(distinct) // 2
    for r in trace:
        wrong = {b.answer for b in r.branches if not is_correct(r, b)}
        assert r.answer not in wrong


def test_gpqa_answers_are_multiple_choice() -> None:
    trace = GPQA.generate(50, 1.0, 8, 400, seed=0)
    answers = {r.answer for r in trace} | {b.answer for _, b in branches(trace)}
    assert answers == {"A", "B", "C", "D", ""}  # "": a loop, which writes none


def test_gaokao_answers_are_numbers() -> None:
    trace = GAOKAO.generate(20, 1.0, 8, 400, seed=0)
    answers = {r.answer for r in trace} | {b.answer for _, b in branches(trace) if b.answer}
    assert all(a.isdigit() and 1 <= int(a) < 1000 for a in answers)
    assert len({r.answer for r in trace}) > 10  # golds differ between requests


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_requests": 0}, "num_requests=0"),
        ({"rate": 0.0}, "rate=0.0"),
        ({"rate": -1.0}, "rate=-1.0"),
        ({"n": 0}, "n=0"),
        ({"interval": 0}, "interval=0"),
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict, field: str) -> None:
    settings = {"num_requests": 2, "rate": 1.0, "n": 2, "interval": 10, **kwargs}
    with pytest.raises(ConfigError, match=field):
        GAOKAO.generate(**settings)


def test_unknown_workload() -> None:
    assert workload("gaokao") is GAOKAO
    assert workload("gpqa") is GPQA
    with pytest.raises(UnknownComponentError) as info:
        workload("nope")
    assert "'nope'" in str(info.value)
    for name in PRESETS:
        assert name in str(info.value)
