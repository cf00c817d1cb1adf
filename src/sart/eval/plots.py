"""Plots of ``sart eval`` (matplotlib, no display).

- ``accuracy_vs_n.png``: accuracy against ``N`` per method, with 95% Wilson
  intervals; Vanilla (``N = 1``) as a horizontal line and band;
- ``accuracy_vs_tokens.png``: accuracy against tokens generated per request,
  one line per method through its ``N`` values (the cost of each point);
- ``accuracy_by_level.png``: per-level accuracy of each method at the largest
  ``N`` (and Vanilla), when the problems have a ``level`` (MATH, the testbed).

With several arrival rates, the plots show the first rate's runs: accuracy and
tokens do not depend on the rate (the tables and ``results.json`` have every
rate's latency).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sart.bench.plots import pyplot, save_figure
from sart.eval.accuracy import EvalRun
from sart.methods import get_method


def write_plots(
    runs: Sequence[EvalRun], out: Path, levels: dict[str, object] | None = None
) -> list[Path]:
    """Write the plots into ``out``; return their paths."""
    plt = pyplot()
    if runs:
        runs = [run for run in runs if run.record.rate == runs[0].record.rate]
    paths = [
        _accuracy_vs_n(plt, runs, out / "accuracy_vs_n.png"),
        _accuracy_vs_tokens(plt, runs, out / "accuracy_vs_tokens.png"),
    ]
    if levels:
        paths.append(_accuracy_by_level(plt, runs, levels, out / "accuracy_by_level.png"))
    return paths


def _methods(runs: Sequence[EvalRun]) -> dict[str, list[EvalRun]]:
    out: dict[str, list[EvalRun]] = {}
    for run in runs:
        out.setdefault(run.method, []).append(run)
    return {m: sorted(rs, key=lambda r: r.n) for m, rs in out.items()}


def _accuracy_vs_n(plt: Any, runs: Sequence[EvalRun], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ns = sorted({r.n for r in runs})
    for method, here in _methods(runs).items():
        if method == "vanilla":
            run = here[0]
            low, high = run.interval
            ax.axhline(
                100 * run.accuracy, color="gray", linestyle="--", label=get_method(method).label
            )
            ax.axhspan(100 * low, 100 * high, color="gray", alpha=0.12)
            continue
        xs = [r.n for r in here]
        ys = [100 * r.accuracy for r in here]
        errors = [
            [100 * (r.accuracy - r.interval[0]) for r in here],
            [100 * (r.interval[1] - r.accuracy) for r in here],
        ]
        ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=get_method(method).label)
    ax.set(title="Accuracy (95% Wilson interval)", xlabel="N", ylabel="accuracy (%)", xticks=ns)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def _accuracy_vs_tokens(plt: Any, runs: Sequence[EvalRun], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method, here in _methods(runs).items():
        xs = [r.tokens_per_request for r in here]
        ys = [100 * r.accuracy for r in here]
        ax.plot(xs, ys, marker="o", label=get_method(method).label)
        for run, x, y in zip(here, xs, ys):
            ax.annotate(f"N={run.n}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(
        title="Accuracy against generation cost",
        xlabel="tokens generated per request",
        ylabel="accuracy (%)",
    )
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def _accuracy_by_level(
    plt: Any, runs: Sequence[EvalRun], levels: dict[str, object], path: Path
) -> Path:
    top = max(r.n for r in runs)
    shown = [r for r in runs if r.n == top or r.method == "vanilla"]
    values = list(shown[0].by_field(levels))
    fig, ax = plt.subplots(figsize=(min(12.0, max(6.5, 0.4 * len(values) * len(shown))), 4))
    width = 0.8 / max(1, len(shown))
    for i, run in enumerate(shown):
        tally = run.by_field(levels)
        ys = [
            100 * tally[v][0] / tally[v][1] if v in tally and tally[v][1] else 0.0 for v in values
        ]
        xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(values))]
        ax.bar(xs, ys, width=width, label=f"{get_method(run.method).label} (N={run.n})")
    ax.set_xticks(range(len(values)), [str(v) for v in values])
    ax.set(title="Accuracy by level", xlabel="level", ylabel="accuracy (%)", ylim=(0, 105))
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


__all__ = ["write_plots"]
