"""Plots of a benchmark, in the shapes of the paper's figures (matplotlib, no display).

- ``latency_accuracy.png`` (Figure 5): P97 end-to-end latency and accuracy
  against ``N`` for each method, Vanilla as a horizontal line; one row per rate.
- ``resources.png`` (Figure 3): running branches and KV tokens over time, for
  one request and for the whole run, with and without pruning.
- ``distributions.png`` (Figure 6): response lengths and queueing times.
- ``rate_sweep.png`` (with two or more ``--rate`` values): P97 end-to-end latency
  and accuracy against the arrival rate, one line per method and ``N``: how each
  fares from idle to overload.
- ``frontier.png`` (with gold answers): accuracy against P97 and against tokens per
  request, every method and ``N``, one column per rate, the frontier drawn
  (``sart.bench.frontier``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sart.bench.frontier import plot_frontier
from sart.bench.runner import BenchConfig, RunRecord
from sart.methods import get_method
from sart.types import BranchStatus


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def write_plots(config: BenchConfig, records: Sequence[RunRecord], out: Path) -> list[Path]:
    """Write every plot into ``out``; return their paths."""
    plt = pyplot()
    paths = [
        _latency_accuracy(plt, config, records, out / "latency_accuracy.png"),
        _resources(plt, config, records, out / "resources.png"),
        _distributions(plt, config, records, out / "distributions.png"),
        _against_rate(plt, config, records, out / "rate_sweep.png"),
    ]
    if any(r.summary.accuracy is not None for r in records):
        paths.append(plot_frontier(plt, config, records, out / "frontier.png"))
    return [p for p in paths if p is not None]


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # figures are not freed otherwise: a long sweep would leak them
    return path


def _unit(config: BenchConfig) -> str:
    return "decode steps" if config.cost == "steps" else "s"


def _rates(records: Sequence[RunRecord]) -> list[float | None]:
    return list(dict.fromkeys(r.rate for r in records))


def _latency_accuracy(
    plt: Any, config: BenchConfig, records: Sequence[RunRecord], path: Path
) -> Path:
    rates = _rates(records)
    fig, axes = plt.subplots(len(rates), 2, figsize=(10, 3.6 * len(rates)), squeeze=False)
    for row, rate in enumerate(rates):
        here = [r for r in records if r.rate == rate]
        lat_ax, acc_ax = axes[row]
        for method in dict.fromkeys(r.method for r in here):
            runs = sorted((r for r in here if r.method == method), key=lambda r: r.n)
            if method == "vanilla":
                s = runs[0].summary
                lat_ax.axhline(
                    s.e2e.p97, color="gray", linestyle="--", label=get_method(method).label
                )
                acc_ax.axhline(
                    100 * (s.accuracy or 0),
                    color="gray",
                    linestyle="--",
                    label=get_method(method).label,
                )
                continue
            ns = [r.n for r in runs]
            lat_ax.plot(
                ns, [r.summary.e2e.p97 for r in runs], marker="o", label=get_method(method).label
            )
            acc_ax.plot(
                ns,
                [100 * (r.summary.accuracy or 0) for r in runs],
                marker="o",
                label=get_method(method).label,
            )
        title = "trace" if rate is None else f"{rate:g} req/s"
        lat_ax.set(
            title=f"P97 E2E latency, {title}",
            xlabel="N",
            ylabel=f"latency ({_unit(config)})",
            xticks=list(config.ns),
        )
        acc_ax.set(
            title=f"Accuracy, {title}", xlabel="N", ylabel="accuracy (%)", xticks=list(config.ns)
        )
        lat_ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def _against_rate(
    plt: Any, config: BenchConfig, records: Sequence[RunRecord], path: Path
) -> Path | None:
    rates = [r for r in _rates(records) if r is not None]
    if len(rates) < 2:
        return None
    fig, (lat_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, n in dict.fromkeys((r.method, r.n) for r in records):
        runs = sorted(
            (r for r in records if (r.method, r.n) == (method, n) and r.rate is not None),
            key=lambda r: r.rate or 0.0,
        )
        label = get_method(method).label + ("" if method == "vanilla" else f", N={n}")
        style = {"color": "gray", "linestyle": "--"} if method == "vanilla" else {}
        xs = [r.rate for r in runs]
        lat_ax.plot(xs, [r.summary.e2e.p97 for r in runs], marker="o", label=label, **style)
        acc_ax.plot(
            xs, [100 * (r.summary.accuracy or 0) for r in runs], marker="o", label=label, **style
        )
    lat_ax.set(
        title="P97 E2E latency against load",
        xlabel="arrival rate (req/s)",
        ylabel=f"latency ({_unit(config)})",
        xscale="log",
        yscale="log",
    )
    acc_ax.set(
        title="Accuracy against load",
        xlabel="arrival rate (req/s)",
        ylabel="accuracy (%)",
        xscale="log",
    )
    for ax in (lat_ax, acc_ax):
        # The swept rates themselves as ticks, in plain numbers: a log axis over
        # 1-4 req/s otherwise labels only 10^0.
        ax.set_xticks(sorted(rates), labels=[f"{r:g}" for r in sorted(rates)])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
    plain = plt.FuncFormatter(lambda value, _pos: f"{value:g}")
    lat_ax.yaxis.set_major_formatter(plain)
    lat_ax.yaxis.set_minor_formatter(plain)
    lat_ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


#: The methods whose runs at the largest ``N`` and the first rate the figures draw
#: request by request (``resources.png``: SART and SART without pruning; and SC in
#: ``distributions.png``); of every other run they read the summary alone.
DRAWN_IN_DETAIL = ("sc", "sart-no-prune", "sart")


def drawn_in_detail(config: BenchConfig, record: RunRecord) -> bool:
    """Whether the figures read ``record``'s requests, per-request KV use or timeline
    (a benchmark's runs come in ``config``'s order of rates, so the first rate the
    figures see is ``config``'s first)."""
    first = config.rates[0] if config.rates else None
    return record.method in DRAWN_IN_DETAIL and record.n == max(config.ns) and record.rate == first


def _pick(
    records: Sequence[RunRecord], method: str, n: int, rate: float | None
) -> RunRecord | None:
    for r in records:
        if r.method == method and r.n == n and r.rate == rate:
            return r
    return None


def _example_request(record: RunRecord) -> str:
    """A representative request: among those with a pruned branch (else all), the
    one with the median inference latency."""
    pruned = [r for r in record.results if any(b.status is BranchStatus.PRUNED for b in r.branches)]
    pool = sorted(pruned or record.results, key=lambda r: r.timings.inference)
    return pool[len(pool) // 2].request_id


def _resources(
    plt: Any, config: BenchConfig, records: Sequence[RunRecord], path: Path
) -> Path | None:
    n, rate = max(config.ns), _rates(records)[0]
    runs = [r for r in (_pick(records, m, n, rate) for m in DRAWN_IN_DETAIL[1:]) if r]
    if not runs:
        return None
    rid = _example_request(runs[-1])
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5))
    for record in runs:
        label = get_method(record.method).label
        timings = next(r.timings for r in record.results if r.request_id == rid)
        start = timings.scheduled or timings.arrival
        # Samples follow each decode call; the request holds nothing once it finishes.
        usage = [*record.request_usage.get(rid, ()), (timings.finished, 0, 0)]
        xs = [t - start for t, _, _ in usage]
        axes[0][0].step(xs, [live for _, live, _ in usage], where="pre", label=label)
        axes[1][0].step(xs, [kv for _, _, kv in usage], where="pre", label=label)
        times = [s.time for s in record.timeline]
        axes[0][1].plot(times, [s.running_branches for s in record.timeline], label=label)
        axes[1][1].plot(times, [s.kv_tokens for s in record.timeline], label=label)
    unit = _unit(config)
    if runs[0].kv_capacity:
        axes[1][1].axhline(runs[0].kv_capacity, color="red", linestyle=":", label="KV capacity")
    axes[0][0].set(title=f"Request {rid} (N={n})", ylabel="running branches")
    axes[1][0].set(xlabel=f"time since it was prefilled ({unit})", ylabel="KV tokens")
    axes[0][1].set(title=f"Whole run (N={n})", ylabel="running branches")
    axes[1][1].set(xlabel=f"time ({unit})", ylabel="KV tokens")
    for ax in axes.flat:
        ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def _distributions(
    plt: Any, config: BenchConfig, records: Sequence[RunRecord], path: Path
) -> Path | None:
    n, rate = max(config.ns), _rates(records)[0]
    runs = [r for r in (_pick(records, m, n, rate) for m in DRAWN_IN_DETAIL) if r]
    if not runs:
        return None
    fig, (len_ax, queue_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    for record in runs:
        label = f"{get_method(record.method).label} (N={record.n})"
        lengths = [
            b.num_tokens for r in record.results for b in r.branches if b.status.is_completed
        ]
        len_ax.hist(lengths, bins=40, histtype="step", density=True, label=label)
        queue = sorted(r.timings.queueing for r in record.results)
        queue_ax.plot(queue, [(i + 1) / len(queue) for i in range(len(queue))], label=label)
    len_ax.set(title="Completed response lengths", xlabel="tokens", ylabel="density")
    queue_ax.set(
        title="Queueing time (CDF)",
        xlabel=f"queueing ({_unit(config)})",
        ylabel="fraction of requests",
    )
    len_ax.legend(fontsize=8)
    queue_ax.legend(fontsize=8)
    return save_figure(plt, fig, path)
