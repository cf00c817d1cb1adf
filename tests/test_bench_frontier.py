"""The accuracy-cost frontier (``sart.bench.frontier``): which runs nothing beats."""

from __future__ import annotations

from types import SimpleNamespace

from sart.bench.frontier import dominated_by, dominates, frontier, label, plot_frontier, tokens
from sart.bench.plots import pyplot
from sart.bench.runner import RunRecord
from sart.metrics import Distribution, RunSummary


def record(method: str, n: int, accuracy: float, p97: float, cost: float, rate: float = 1.0):
    e2e = Distribution(p50=p97 / 2, p90=p97, p97=p97, p99=p97, mean=p97 / 2, max=p97)
    summary = RunSummary(
        requests=10,
        failed=0,
        accuracy=accuracy,
        e2e=e2e,
        queueing=e2e,
        inference=e2e,
        tokens_per_request=cost,
        peak_running_branches=1,
        peak_kv_tokens=1,
        makespan=1.0,
        prm_wait=e2e,
    )
    return RunRecord(method, n, rate, summary, (), (), {}, None, 8)


def test_a_run_is_dominated_only_by_one_no_worse_in_both_and_better_in_one() -> None:
    a = record("sart", 8, 0.80, 10.0, 3000)
    b = record("rebase", 8, 0.95, 15.0, 9000)
    c = record("sc", 8, 0.70, 17.0, 7000)
    twin = record("sart-no-prune", 8, 0.80, 10.0, 3000)
    assert dominates(a, c) and dominates(b, c)
    assert not dominates(a, b) and not dominates(b, a)
    assert not dominates(a, twin) and not dominates(twin, a)  # equal is not better
    assert dominated_by(c, [a, b, c]) == [a, b]
    assert frontier([c, b, a]) == [a, b]  # cheapest first
    # By tokens instead: the same here.
    assert frontier([c, b, a], tokens) == [a, b]


def test_runs_at_another_rate_never_dominate() -> None:
    slow = record("sart", 8, 0.80, 50.0, 3000, rate=1.0)
    idle = record("rebase", 8, 0.95, 15.0, 9000, rate=0.25)
    assert dominated_by(slow, [slow, idle]) == []


def test_labels_name_registered_methods_and_a_plugins_variant_alike(tmp_path) -> None:
    assert label(record("sart-rebranch", 8, 0.9, 10.0, 3000)) == "SART-rebranch 8"
    assert label(record("vanilla", 1, 0.5, 1.0, 300)) == "Vanilla"
    # A variant a --plugin served is no longer registered when the figure is drawn.
    assert label(record("rb-agree-off", 8, 0.9, 10.0, 3000)) == "rb-agree-off 8"
    runs = [record("rb-agree-off", 8, 0.87, 24.9, 3762), record("sart", 8, 0.8, 18.3, 3521)]
    path = plot_frontier(pyplot(), SimpleNamespace(cost="s"), runs, tmp_path / "f.png")
    assert path.stat().st_size > 0
