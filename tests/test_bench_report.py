"""``report_view``: what ``sart bench`` keeps of a finished run is all its report reads."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from sart.bench.report import render, report_view
from sart.bench.runner import BenchConfig, run_bench


def table(config: BenchConfig, records: list) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    render(config, records, console)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_the_table_and_the_figures_from_what_is_kept_are_those_from_whole_runs(
    tmp_path: Path,
) -> None:
    pytest.importorskip("rich")
    pytest.importorskip("matplotlib")
    from sart.bench.plots import write_plots

    config = BenchConfig(
        methods=("vanilla", "sc", "sart-no-prune", "sart"),
        ns=(2, 4),
        rates=(1.0, 4.0),
        num_requests=10,
        slo=200.0,
    )
    records = run_bench(config)
    views = [report_view(config, plots=True)(r) for r in records]
    assert sum(v.results != () and v.results[0].branches != () for v in views) == 3
    assert table(config, views) == table(config, records)
    whole, kept = tmp_path / "whole", tmp_path / "kept"
    whole.mkdir(), kept.mkdir()
    drawn = write_plots(config, records, whole)
    assert [p.name for p in write_plots(config, views, kept)] == [p.name for p in drawn]
    for path in drawn:
        assert (kept / path.name).read_bytes() == path.read_bytes(), path.name


def test_without_figures_or_an_slo_only_the_summary_is_kept() -> None:
    config = BenchConfig(methods=("sart",), ns=(2,), rates=(1.0,), num_requests=4)
    (record,) = run_bench(config)
    view = report_view(config, plots=False)(record)
    assert view.results == () and view.timeline == () and view.request_usage == {}
    assert view.summary == record.summary
