"""Workloads resampled from a recorded trace (``sart.bench.resample``)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sart
from sart.bench.resample import ResampledWorkload
from sart.bench.traces import Trace, TraceRequest
from sart.bench.workloads import workload
from sart.engines.scripts import BranchScript


def recorded(requests: int = 5, width: int = 4, interval: int = 100) -> Trace:
    """A small 'recorded' trace: request k's branches have lengths 1000k + 10j and
    rewards every ``interval`` tokens that name their branch."""
    out = []
    for k in range(requests):
        branches = []
        for j in range(width):
            length = 1000 * (k + 1) + 10 * j
            checks = (length - 1) // interval
            rewards = tuple(round(0.01 * j + 0.001 * c, 4) for c in range(checks))
            branches.append(
                BranchScript(length=length, answer=f"{k}-{j}", rewards=rewards, filler="")
            )
        out.append(
            TraceRequest(f"q{k}", 0.5 * k, str(k), tuple(branches), 100 + k, interval=interval)
        )
    return Trace.of(out)


def source_of(request: TraceRequest, trace: Trace) -> TraceRequest:
    return next(r for r in trace if r.answer == request.answer)


@settings(max_examples=40)
@given(n=st.integers(1, 7), seed=st.integers(0, 50), count=st.integers(1, 40))
def test_each_request_is_a_recorded_one_with_its_own_branches(n, seed, count) -> None:
    trace = recorded()
    model = ResampledWorkload.of(trace)
    made = model.generate(count, 2.0, n, 100, seed)
    assert len(made) == count and made.width == n
    arrivals = [r.arrival for r in made]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    for request in made:
        source = source_of(request, trace)
        assert request.prompt_tokens == source.prompt_tokens
        assert all(b in source.branches for b in request.branches)
        if n <= len(source.branches):  # drawn without replacement
            assert len(set(request.branches)) == n
    assert made == model.generate(count, 2.0, n, 100, seed)  # deterministic


def test_a_coarser_interval_keeps_every_kth_reward() -> None:
    model = ResampledWorkload.of(recorded(interval=100))
    made = model.generate(10, 1.0, 4, 300, seed=1)
    for request in made:
        source = source_of(request, recorded())
        for branch in request.branches:
            original = next(b for b in source.branches if b.answer == branch.answer)
            assert branch.rewards == original.rewards[2::3]
    with pytest.raises(sart.ConfigError, match="interval=150 must be a multiple of"):
        model.generate(10, 1.0, 4, 150)


def test_a_trace_file_is_a_workload_for_sart_bench(tmp_path: Path) -> None:
    from sart.cli import main

    path = tmp_path / "recorded.jsonl"
    recorded().dump(path)
    assert isinstance(workload(str(path)), ResampledWorkload)
    out = tmp_path / "bench"
    code = main(
        ["bench", "--workload", str(path), "--requests", "30", "--rate", "2", "--n", "2", "4",
         "--methods", "sc", "sart", "--no-plots", "--out", str(out), "--cost-model", "steps"]
    )  # fmt: skip
    assert code == 0
    text = (out / "results.json").read_text()
    assert '"interval": 100' in text  # the recorded T is the default


def test_a_missing_or_mixed_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(sart.ConfigError, match="no such trace file"):
        workload(str(tmp_path / "nothing.jsonl"))
    other = attrs.evolve(recorded(1, interval=200).requests[0], id="other")
    mixed = Trace.of([recorded(1, interval=100).requests[0], other])
    with pytest.raises(sart.ConfigError, match="do not all record one interval"):
        ResampledWorkload.of(mixed)
