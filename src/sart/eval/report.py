"""Reports of ``sart eval``: ``results.json`` and the table, one row per method and ``N``.

``results.json`` (schema ``sart.eval/1``)::

    {"schema": "sart.eval/1", "complete": true, "mode": "derived",
     "dataset": {"name": "math500", "source": "...", "problems": 500, "grading": "math-verify"},
     "settings": {...what generated the branches: the problems.jsonl header's...},
     "config": {"methods": [...], "ns": [2, 4, 8], "rates": [1.0], "rate": 1.0,
                "cost_model": "h100-14b", ...},
     "time_unit": "seconds (simulated: h100-14b)",
     "wall_seconds": {"record": 812.5, "derive": 3.1, "serve": null},
     "runs": [{"method": "sart", "n": 8, "rate": 1.0, "problems": 500, "correct": 431,
               "accuracy": 0.862, "ci95": [0.829, 0.889], "tokens_per_request": 9120.4,
               "latency": {"p50": ..., "p97": ...}, "levels": {"1": {...}}, "requests": [...]}]}

One run per method, ``N`` and arrival rate (``config.rate`` is the first of
``config.rates``); ``complete`` is false while a run is under way or after it was interrupted;
``requests`` holds each problem's selected answer, grade, tokens and latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from sart.eval.accuracy import EvalRun
from sart.methods import get_method

SCHEMA = "sart.eval/1"


def run_json(run: EvalRun, levels: dict[str, object] | None = None) -> dict[str, Any]:
    """One method at one ``N``; ``levels`` (problem id -> level) adds per-level accuracy."""
    summary = run.record.summary
    low, high = run.interval
    out: dict[str, Any] = {
        "method": run.method,
        "label": get_method(run.method).label,
        "n": run.n,
        "rate": run.record.rate,
        "problems": run.problems,
        "correct": run.num_correct,
        "accuracy": run.accuracy,
        "ci95": [low, high],
        "failed": summary.failed,
        "tokens_per_request": run.tokens_per_request,
        "latency": attrs.asdict(summary.e2e),
        "makespan": summary.makespan,
    }
    if levels:
        out["levels"] = {
            str(level): {"correct": right, "problems": total, "accuracy": right / total}
            for level, (right, total) in run.by_field(levels).items()
        }
    out["requests"] = [
        {
            "id": result.request_id,
            "answer": result.answer,
            "correct": correct,
            "chosen": result.chosen,
            "tokens": result.generated_tokens,
            "e2e": result.timings.end_to_end,
        }
        for result, correct in zip(run.record.results, run.correct)
    ]
    return out


def eval_json(
    *,
    mode: str,
    dataset: dict[str, Any],
    settings: dict[str, Any],
    config: dict[str, Any],
    time_unit: str,
    wall_seconds: dict[str, float | None],
    runs: Sequence[EvalRun],
    levels: dict[str, object] | None = None,
    complete: bool,
) -> dict[str, Any]:
    """The whole evaluation as one JSON document (see the module docstring)."""
    return {
        "schema": SCHEMA,
        "complete": complete,
        "mode": mode,
        "dataset": dataset,
        "settings": settings,
        "config": config,
        "time_unit": time_unit,
        "percentiles": "nearest-rank: the P-th percentile is the ceil(P/100 * n)-th smallest value",
        "wall_seconds": wall_seconds,
        "runs": [run_json(run, levels) for run in runs],
    }


def _latency(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def render(runs: Sequence[EvalRun], console: Any, title: str, unit: str) -> None:
    """A rich table: accuracy with its 95% Wilson interval, tokens per request, P50 and
    P97 end-to-end latency (in ``unit``), per method and ``N`` (and rate, if several)."""
    from rich.table import Table

    rates = len({run.record.rate for run in runs}) > 1
    table = Table(title=title)
    table.add_column("method")
    table.add_column("N", justify="right")
    if rates:
        table.add_column("req/s", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("95% CI", justify="right")
    table.add_column("tokens/req", justify="right")
    table.add_column(f"P50 ({unit})", justify="right")
    table.add_column(f"P97 ({unit})", justify="right")
    for run in runs:
        low, high = run.interval
        e2e = run.record.summary.e2e
        rate = [f"{run.record.rate:g}"] if rates else []
        table.add_row(
            get_method(run.method).short_label,
            str(run.n),
            *rate,
            f"{100 * run.accuracy:.1f}% ({run.num_correct}/{run.problems})",
            f"{100 * low:.1f}-{100 * high:.1f}%",
            f"{run.tokens_per_request:,.0f}",
            _latency(e2e.p50),
            _latency(e2e.p97),
        )
    console.print(table)


__all__ = ["SCHEMA", "eval_json", "render", "run_json"]
