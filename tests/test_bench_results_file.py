"""``ResultsFile``: results.json written from each run's entry, made once, and what it
keeps of the runs in memory."""

from __future__ import annotations

import gc
import json
import tracemalloc
import weakref
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from sart.bench.report import bench_header, bench_json, report_view, run_json
from sart.bench.results_file import ResultsFile, write_json
from sart.bench.run_log import run_key
from sart.bench.runner import BenchConfig, plan, run_bench, run_method, traces


def sink_of(tmp_path: Path, config: BenchConfig, *, plots: bool = False, **kw: bool) -> ResultsFile:
    return ResultsFile(
        tmp_path,
        config,
        bench_header,
        lambda record, gold: run_json(record, gold, config.slo),
        retain=report_view(config, plots=plots),
        **kw,
    )


@pytest.mark.parametrize("slo", [None, 150.0])
def test_results_json_is_the_whole_document_as_json_dumps_writes_it(
    tmp_path: Path, slo: float | None
) -> None:
    # Written piecewise (a header, then each run's entry made when the run finished):
    # the bytes are those of the document built whole, as results.json always was.
    config = BenchConfig(methods=("vanilla", "sart"), ns=(2,), rates=(1.0, 4.0), num_requests=8)
    config = attrs.evolve(config, slo=slo)
    records = run_bench(config)
    gold = {rate: trace.gold() for rate, trace in traces(config)}
    sink = sink_of(tmp_path, config)
    sink.gold = gold
    sink.begin(None, [(rate, m, n) for rate, _ in traces(config) for m, n in plan(config)])
    sink.elapsed = lambda: 12.5  # type: ignore[method-assign]
    for record in reversed(records):  # finishing out of order: listed in the report's
        sink.add(record)
    printed = sink.write(complete=True)
    sink.close()
    whole = bench_json(config, records, gold, 12.5) | {"complete": True, "resumed": []}
    assert (tmp_path / "results.json").read_text() == json.dumps(whole, indent=1)
    assert [run["method"] for run in whole["runs"]] == ["vanilla", "sart", "vanilla", "sart"]
    # What sart bench --json prints: the same runs, without requests and timelines.
    brief = [
        {k: v for k, v in run.items() if k not in ("requests", "timeline")} for run in whole["runs"]
    ]
    assert printed == whole | {"runs": brief}


def test_an_empty_benchmark_writes_an_empty_list_of_runs(tmp_path: Path) -> None:
    config = BenchConfig(methods=("sart",), ns=(2,), rates=(1.0,), num_requests=4)
    sink = sink_of(tmp_path, config)
    sink.begin(None, [(1.0, "sart", 2)])
    sink.elapsed = lambda: 0.0  # type: ignore[method-assign]
    sink.write(complete=False)
    sink.close()
    whole = bench_json(config, [], {}, 0.0) | {"complete": False, "resumed": []}
    assert (tmp_path / "results.json").read_text() == json.dumps(whole, indent=1)


@pytest.mark.parametrize("plots", [False, True])
def test_a_finished_runs_requests_are_let_go_unless_a_figure_draws_them(
    tmp_path: Path, plots: bool
) -> None:
    # Every run was kept whole until the end (results, branches, per-request KV use):
    # sart bench --requests 4000 grew to 2.5 GB. Once a run is logged and its entry
    # written, its requests are released, except those of the runs the figures draw.
    config = BenchConfig(methods=("sc", "sart"), ns=(2, 4), rates=(1.0,), num_requests=6)
    ((rate, trace),) = traces(config)
    sink = sink_of(tmp_path, config, plots=plots)
    sink.begin(None, [(rate, m, n) for m, n in plan(config)])
    watched = {}
    for method, n in plan(config):
        record = run_method(trace, method, n, config, rate)
        watched[run_key(record)] = (weakref.ref(record), weakref.ref(record.results[0]))
        sink.add(record)
        del record
    sink.close()
    gc.collect()
    for (_, method, n), (record, result) in watched.items():
        drawn = plots and n == 4  # SC and SART at the largest N, on the first rate
        assert (record() is not None) == drawn, (method, n)
        assert (result() is not None) == drawn, (method, n)
    kept = {run_key(r): r for r in sink.records}
    assert all(r.summary.requests == 6 for r in kept.values())
    assert kept[(1.0, "sart", 2)].results == () and kept[(1.0, "sart", 2)].timeline == ()


def test_a_resumed_benchmark_keeps_the_logged_runs_as_it_keeps_its_own(
    tmp_path: Path,
) -> None:
    config = BenchConfig(methods=("sc", "sart"), ns=(2,), rates=(1.0,), num_requests=5)
    keys = [(1.0, m, n) for m, n in plan(config)]
    first = sink_of(tmp_path, config)
    first.begin(None, keys[:1])
    first.add(run_bench(attrs.evolve(config, methods=("sc",)))[0])
    first.write(complete=False)
    first.close()
    again = sink_of(tmp_path, config, resume=True)
    assert again.begin(None, keys) == {keys[0]}
    (kept,) = again.kept
    assert kept.results == () and kept.summary.requests == 5
    again.close()


def peak_while(action: Callable[[], object]) -> int:
    """The most memory Python allocated during ``action``, above what it held before."""
    gc.collect()
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_results_json_is_rewritten_without_holding_it_in_memory(tmp_path: Path) -> None:
    # Each rewrite built the whole document, then its text (json.dumps with an indent
    # joins every piece): several times the file's size, at every rewrite.
    config = BenchConfig(methods=("sart",), ns=(8,), rates=(1.0,), num_requests=300)
    sink = sink_of(tmp_path, config)
    sink.begin(None, [(1.0, m, n) for m, n in plan(config)])
    for record in run_bench(config):
        sink.add(record)
    del record
    size = (tmp_path / "results.json").stat().st_size
    assert peak_while(lambda: sink.write(complete=True)) < size / 4
    sink.close()


def test_write_json_streams_the_document(tmp_path: Path) -> None:
    document = {"rows": [{"id": f"r{i}", "values": list(range(20))} for i in range(2000)]}
    path = tmp_path / "results.json"
    peak = peak_while(lambda: write_json(path, document))
    assert path.read_text() == json.dumps(document, indent=1)
    assert peak < path.stat().st_size / 4
