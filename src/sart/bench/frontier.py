"""The accuracy-cost frontier of a benchmark: which runs no other run beats.

A run *dominates* another at the same rate when it is at least as accurate and
at least as cheap (P97 end-to-end latency, or tokens per request), and strictly
better in one of the two. The frontier is the runs nothing dominates: the ones a
user should choose between. ``frontier.png`` (one column per rate; accuracy
against P97 above, against tokens per request below, every method and ``N``,
95% intervals as bars, the frontier as a line) is drawn by ``sart bench`` with
the other plots, and by ``sart bench --resume`` from a kept ``runs.jsonl``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sart.bench.runner import BenchConfig, RunRecord
from sart.methods import Method, get_method, method_names

Cost = Callable[[RunRecord], float]


def p97(record: RunRecord) -> float:
    return record.summary.e2e.p97


def tokens(record: RunRecord) -> float:
    return record.summary.tokens_per_request


def accuracy(record: RunRecord) -> float:
    return record.summary.accuracy or 0.0


def dominates(a: RunRecord, b: RunRecord, cost: Cost = p97) -> bool:
    """Whether ``a`` is at least as accurate and as cheap as ``b``, and better in one."""
    no_worse = accuracy(a) >= accuracy(b) and cost(a) <= cost(b)
    return no_worse and (accuracy(a) > accuracy(b) or cost(a) < cost(b))


def dominated_by(
    record: RunRecord, records: Sequence[RunRecord], cost: Cost = p97
) -> list[RunRecord]:
    """The runs at ``record``'s rate that dominate it."""
    return [r for r in records if r.rate == record.rate and dominates(r, record, cost)]


def frontier(records: Sequence[RunRecord], cost: Cost = p97) -> list[RunRecord]:
    """The runs (all of one rate) nothing dominates, cheapest first."""
    front = [r for r in records if not dominated_by(r, records, cost)]
    return sorted(front, key=lambda r: (cost(r), -accuracy(r)))


def label(record: RunRecord) -> str:
    """``record``'s method and N as the figure names it; a method no longer registered
    (a variant a plugin served) by its name."""
    method = _registered(record.method)
    if method is None:
        return f"{record.method} {record.n}"
    return method.short_label if not method.branches else f"{method.short_label} {record.n}"


def _registered(name: str) -> Method | None:
    """The method registered as ``name`` (``None``: a plugin's, not loaded here)."""
    return get_method(name) if name in method_names() else None


def _legend(name: str) -> str:
    method = _registered(name)
    return name if method is None else method.label


def plot_frontier(plt: Any, config: BenchConfig, records: Sequence[RunRecord], path: Path) -> Path:
    """``frontier.png``: see the module docstring."""
    from sart.bench.plots import save_figure

    rates = list(dict.fromkeys(r.rate for r in records))
    fig, axes = plt.subplots(2, len(rates), figsize=(6.2 * len(rates), 9.5), squeeze=False)
    unit = "decode steps" if config.cost == "steps" else "s"
    # In the registry's order, so that every figure colours a method alike.
    known = {name: i for i, name in enumerate(method_names())}
    methods = sorted(
        dict.fromkeys(r.method for r in records), key=lambda m: known.get(m, len(known))
    )
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    markers = {n: "os^Dvp*h"[i % 8] for i, n in enumerate(sorted({r.n for r in records}))}
    plain = plt.FuncFormatter(lambda v, _p: f"{v:g}")
    # On a log axis over less than a decade only minor ticks fall inside: label the
    # 2s and 5s among them, in plain numbers, or all of them over less than half a
    # decade (5.6 to 9.7 s has no 2 or 5 in it).
    some = plt.FuncFormatter(lambda v, _p: f"{v:g}" if f"{v:g}"[0] in "25" else "")
    for col, rate in enumerate(rates):
        here = [r for r in records if r.rate == rate]
        title = "trace" if rate is None else f"{rate:g} req/s"
        for row, (cost, xlabel) in enumerate(
            ((p97, f"P97 E2E latency ({unit})"), (tokens, "tokens per request"))
        ):
            ax = axes[row][col]
            for r in here:
                acc = 100 * accuracy(r)
                low, high = r.summary.accuracy_interval or (accuracy(r), accuracy(r))
                ax.errorbar(
                    cost(r),
                    acc,
                    yerr=[[acc - 100 * low], [100 * high - acc]],
                    color=colors[r.method],
                    marker=markers[r.n],
                    capsize=2,
                    linestyle="none",
                )
                ax.annotate(
                    label(r), (cost(r), acc), fontsize=7, xytext=(4, 3), textcoords="offset points"
                )
            front = frontier(here, cost)
            ax.step(
                [cost(r) for r in front],
                [100 * accuracy(r) for r in front],
                where="post",
                color="black",
                linewidth=0.8,
                alpha=0.5,
            )
            ax.set(
                title=f"Accuracy against {'P97' if row == 0 else 'tokens'}, {title}",
                xlabel=xlabel,
                ylabel="accuracy (%)",
                xscale="log",
            )
            low, high = ax.get_xlim()
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(plain if high < 3 * low else some)
    handles = [
        plt.Line2D([], [], color=colors[m], marker="o", linestyle="none", label=_legend(m))
        for m in methods
    ]
    handles += [
        plt.Line2D([], [], color="gray", marker=mk, linestyle="none", label=f"N = {n}")
        for n, mk in markers.items()
    ]
    axes[0][0].legend(handles=handles, fontsize=7, loc="lower right")
    return save_figure(plt, fig, path)
