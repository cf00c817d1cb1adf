"""Reports of a benchmark: the JSON document, the headline ratios, and the rich table."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from sart.bench.runner import BenchConfig, RunRecord, prm_cost_model
from sart.methods import get_method
from sart.metrics import Distribution, RunSummary, request_record, slo_attainment

SCHEMA = "sart.bench/1"


def _dist(d: Distribution) -> dict[str, float]:
    return attrs.asdict(d)


def summary_json(s: RunSummary) -> dict[str, Any]:
    out = attrs.asdict(s, recurse=False)
    for key in ("e2e", "queueing", "inference", "prm_wait"):
        out[key] = _dist(getattr(s, key))
    return out


def run_json(
    record: RunRecord, gold: dict[str, str] | None = None, slo: float | None = None
) -> dict[str, Any]:
    """One run as plain data; with ``slo``, its ``slo_attainment`` too."""
    gold = gold or {}
    return {
        "method": record.method,
        "label": get_method(record.method).label,
        "n": record.n,
        "rate": record.rate,
        "kv_capacity": record.kv_capacity,
        "preemptions": record.preemptions,
        "over_capacity": record.over_capacity,
        "batch_size": record.batch_size,
        "summary": summary_json(record.summary),
        **({"slo_attainment": slo_attainment(record.results, slo)} if slo is not None else {}),
        # Run totals; the per-request wait is in summary.prm_wait and each request.
        "prm": {
            "busy_seconds": record.prm_busy,
            "wait_seconds": record.prm_wait,
            "tokens": record.prm_tokens,
        },
        "requests": [request_record(r, gold.get(r.request_id)) for r in record.results],
        "timeline": [[s.time, s.running_branches, s.kv_tokens] for s in record.timeline],
    }


def report_view(config: BenchConfig, *, plots: bool) -> Callable[[RunRecord], RunRecord]:
    """What ``sart bench`` keeps in memory of a finished run, once the run is in
    ``runs.jsonl`` whole and its ``results.json`` entry is written: what the table and,
    when ``plots``, the figures read of it (``render``, ``write_plots``).

    That is the summary of every run; each request's status and timings too with an
    SLO (its column); and the whole record only of the few runs the figures draw
    request by request (``sart.bench.plots.drawn_in_detail``). Kept whole, every run's
    requests, branches and per-request KV samples made the memory of
    ``sart bench --requests 4000`` 2.5 GB, growing with every run."""
    from sart.bench.plots import drawn_in_detail

    def view(record: RunRecord) -> RunRecord:
        if plots and drawn_in_detail(config, record):
            return record
        results = (
            ()
            if config.slo is None
            else tuple(attrs.evolve(r, text=None, branches=()) for r in record.results)
        )
        return attrs.evolve(record, results=results, timeline=(), request_usage={})

    return view


def bench_json(
    config: BenchConfig,
    records: Sequence[RunRecord],
    gold: dict[float | None, dict[str, str]],
    wall_seconds: float,
    serving: dict[str, Any] | None = None,
    inputs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole benchmark as one JSON document (``results.json``); ``serving``
    (real engines: model, PRM, sampling settings) and ``inputs`` (the files requests
    came from, ``sart.bench.inputs``) are recorded as given.

    ``sart bench`` writes the same document piecewise (``ResultsFile``): this header,
    then each run's ``run_json``, made once as the run finishes."""
    runs = [run_json(r, gold.get(r.rate), config.slo) for r in records]
    return bench_header(config, records, wall_seconds, serving, inputs) | {"runs": runs}


def bench_header(
    config: BenchConfig,
    records: Sequence[RunRecord],
    wall_seconds: float,
    serving: dict[str, Any] | None = None,
    inputs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``bench_json`` up to its ``runs``: what the benchmark was, and the ratios of
    ``records``' summaries (which is all of them it reads)."""
    return {
        "schema": SCHEMA,
        "config": config_json(config),
        "serving": serving,
        "inputs": inputs or {},
        "percentiles": "nearest-rank: the P-th percentile is the ceil(P/100 * n)-th smallest value",
        "time_unit": (
            "seconds (wall clock)"
            if config.engine != "sim"
            else "decode steps"
            if config.cost == "steps"
            else "seconds (simulated)"
        ),
        "wall_seconds": wall_seconds,
        "ratios_p97": ratios(records),
    }


def config_json(config: BenchConfig) -> dict[str, Any]:
    """``config`` as a report records it (``results.json``'s ``config``, and
    ``tune.json``'s): what ``--resume`` compares with the run it would go on from."""
    cfg = attrs.asdict(config)
    cfg["admission"] = config.admission.value
    cfg["scoring"] = config.scoring.value
    cfg["prm_pricing"] = prm_pricing(config)
    return cfg


def prm_pricing(config: BenchConfig) -> dict[str, Any] | None:
    """How the simulator priced the PRM (``None``: free, or a real PRM's wall clock)."""
    model = prm_cost_model(config)
    if model is None:
        return None
    return {
        "model": model.name,
        "params": model.model.params,
        "context": model.window,
        "placement": config.prm_placement,
        "replicas": config.prm_replicas,
        "input": config.prm_cost,
        "effective_flops": model.flops,
        "call_overhead_seconds": model.call_overhead,
        "tail_tokens": model.tail_tokens if config.prm_cost == "incremental" else None,
    }


def ratios(records: Sequence[RunRecord], field: str = "p97") -> list[dict[str, Any]]:
    """For every rate and ``n``: SC / SART and Vanilla / SART of the E2E percentile, and
    SC / SART-blocking and SART-blocking / SART when the run has blocking SART."""
    index = {(r.rate, r.method, r.n): getattr(r.summary.e2e, field) for r in records}
    out = []
    for (rate, method, n), value in index.items():
        if method != "sart" or not value:
            continue
        row: dict[str, Any] = {"rate": rate, "n": n}
        sc = index.get((rate, "sc", n))
        vanilla = index.get((rate, "vanilla", 1))
        row["sc_over_sart"] = sc / value if sc is not None else None
        row["vanilla_over_sart"] = vanilla / value if vanilla is not None else None
        blocking = index.get((rate, "sart-blocking", n))
        if blocking:
            row["sc_over_sart_blocking"] = sc / blocking if sc is not None else None
            row["sart_blocking_over_sart"] = blocking / value
        out.append(row)
    return out


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if digits and abs(x) >= 100:  # long latencies: the decimals are noise
        digits = 0
    return f"{x:,.{digits}f}"


def _interval(interval: tuple[float, float] | None) -> str:
    """A 95% interval of an accuracy, in percent (``72–86``)."""
    if interval is None:
        return "-"
    low, high = interval
    return f"{100 * low:.0f}–{100 * high:.0f}"


def _rate(x: float) -> str:
    """An arrival rate as given (0.05 stays 0.05; 4.0 prints 4)."""
    return f"{x:g}"


def _time(x: float) -> str:
    """A latency: milliseconds matter for wall-clock runs of tiny models."""
    return _fmt(x, 3 if abs(x) < 1 else 1)


def _setting(config: BenchConfig) -> str:
    if config.engine == "hf":
        return f"transformers model {config.model}"
    if config.engine == "vllm":
        return f"vLLM model {config.model}"
    if config.engine == "sglang":
        return f"SGLang model {config.model}"
    if config.engine != "sim":
        return f"{config.engine} model {config.model}"
    if config.trace is not None:
        return f"trace {config.trace} on {config.cost}"
    return f"{config.workload} workload on {config.cost}"


def _prm_setting(config: BenchConfig) -> str:
    """E.g. ``PRM reencode, own H100, overlapped`` (``4x own H100`` with 4 replicas)."""
    model = prm_cost_model(config)
    if config.prm_cost is None:  # a real PRM
        return f"{config.scoring.value} PRM checks"
    if model is None:
        return f"PRM free, {config.scoring.value}"
    kind = model.name.rsplit(" on ", 1)[-1].split("-")[0]
    count = f"{config.prm_replicas}x " if (config.prm_replicas or 1) > 1 else ""
    return f"PRM {config.prm_cost}, {count}{config.prm_placement} {kind}, {config.scoring.value}"


def _batch_sizes(records: Sequence[RunRecord]) -> str:
    return "/".join(str(b) for b in dict.fromkeys(r.batch_size for r in records))


def _print(console: Any, table: Any) -> None:
    """``table`` at its own width where the output is a file or a pipe (a log, CI):
    rich would fit it to a width it guesses and wrap cells (a ``p151`` mark on a line
    of its own). A terminal's width is known, and kept."""
    if console.is_terminal:
        console.print(table)
        return
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    width = console.width
    console.width = max(width, natural)  # print's own width= is capped at the console's
    try:
        console.print(table)
    finally:
        console.width = width


def render(config: BenchConfig, records: Sequence[RunRecord], console: Any) -> None:
    """Print the results table and the P97 ratios with rich."""
    from rich import box
    from rich.table import Table

    unit = "steps" if config.engine == "sim" and config.cost == "steps" else "s"
    title = (
        f"sart bench: {_setting(config)}, "
        f"B={_batch_sizes(records)}, T={config.interval}; {_prm_setting(config)}; "
        f"E2E latency in {unit}"
        + ("" if config.slo is None else f"; SLO %: answered within {config.slo:g} {unit}")
    )
    # min_width: a title wider than the columns would wrap (a terminal still caps it).
    table = Table(title=title, box=box.SIMPLE_HEAD, min_width=len(title))
    # Failed requests are counted apart (and left out of the percentiles); the column
    # appears only when a run had any, so that the usual table stays as it was.
    failures = any(r.summary.failed for r in records)
    intervals = any(r.summary.accuracy_interval is not None for r in records)
    for name in (
        "rate",
        "method",
        "N",
        *(["failed"] if failures else []),
        "acc %",
        *(["95% CI"] if intervals else []),
        "P50",
        "P90",
        "P97",
        "P99",
        *(["SLO %"] if config.slo is not None else []),
        f"queue {unit}",
        "PRM wait",
        "tokens/req",
        "peak KV",
    ):
        table.add_column(name, justify="left" if name == "method" else "right")
    for r in records:
        s = r.summary
        peak = _fmt(s.peak_kv_tokens, 0)
        if r.over_capacity:
            peak = f"[red]{peak}![/red]"
        elif r.preemptions:
            peak = f"{peak} [yellow]p{r.preemptions}[/yellow]"
        table.add_row(
            "trace" if r.rate is None else _rate(r.rate),
            get_method(r.method).short_label,
            str(r.n),
            *([f"[red]{s.failed}[/red]" if s.failed else "0"] if failures else []),
            _fmt(None if s.accuracy is None else 100 * s.accuracy),
            *([_interval(s.accuracy_interval)] if intervals else []),
            _time(s.e2e.p50),
            _time(s.e2e.p90),
            _time(s.e2e.p97),
            _time(s.e2e.p99),
            *(
                [_fmt(100 * slo_attainment(r.results, config.slo))]
                if config.slo is not None
                else []
            ),
            _time(s.queueing.mean),
            _time(s.prm_wait.mean),
            _fmt(s.tokens_per_request, 0),
            peak,
        )
    _print(console, table)
    # Only where SART has something to be compared with (SC or Vanilla at its rate).
    rows = [
        r
        for r in ratios(records)
        if any(v is not None for k, v in r.items() if k not in ("rate", "n"))
    ]
    if rows:
        title = "P97 E2E latency ratios (above 1: SART is faster)"
        ratio_table = Table(title=title, box=box.SIMPLE_HEAD, min_width=len(title))
        blocking = any("sart_blocking_over_sart" in row for row in rows)
        names = ["rate", "N", "SC / SART", "Vanilla / SART"]
        if blocking:
            names += ["SC / SART-blocking", "SART-blocking / SART"]
        for name in names:
            ratio_table.add_column(name, justify="right")
        for row in rows:
            cells = [
                "trace" if row["rate"] is None else _rate(row["rate"]),
                str(row["n"]),
                _fmt(row["sc_over_sart"], 2),
                _fmt(row["vanilla_over_sart"], 2),
            ]
            if blocking:
                cells += [
                    _fmt(row.get("sc_over_sart_blocking"), 2),
                    _fmt(row.get("sart_blocking_over_sart"), 2),
                ]
            ratio_table.add_row(*cells)
        _print(console, ratio_table)
    if any(r.over_capacity for r in records):
        console.print(
            "[red]![/red] KV above the model's KV capacity at some step (perhaps inside a "
            "decode call, between the samples of peak KV): on a real engine those runs "
            "would preempt; lower --batch-size."
        )
    if any(r.preemptions for r in records):
        console.print(
            "[yellow]pK[/yellow]: the engine preempted K branches for want of KV (freed, "
            "recomputed when resumed, as vLLM does); their latency includes it."
        )
