"""``sart bench --mix``: each rate's mixed workload served first come first served and then
by priority, compared per class, in the simulator or on a real engine."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sart.bench.results_file import check_not_interrupted, check_writable, write_json
from sart.bench.runner import BenchConfig
from sart.bench.workloads import workload
from sart.errors import ConfigError
from sart.flags import equivalence_of
from sart.launch import Loaded, load


def bench_mix(args: argparse.Namespace, config: BenchConfig) -> int:
    """``--mix``: each rate's mixed workload served FCFS and by priority, per class."""
    from rich.console import Console

    from sart.bench.mix import parse_mix

    if args.ns or args.methods:
        raise ConfigError("--mix names each class's method and N: drop --methods and --n")
    classes = parse_mix(args.mix)
    # With --json the tables go to stderr and stdout carries the document, as for the
    # other runs of sart bench.
    console = Console(stderr=args.json, width=None if Console().is_terminal else 120)
    path = check_writable(Path(args.out), command="sart bench")
    check_not_interrupted(Path(args.out))  # a mix would replace its results.json
    serve_rate, loaded = (
        _on_real_engine(args, config, classes) if args.engine != "sim" else (None, None)
    )
    try:
        documents = _mix_rates(config, classes, console, serve_rate)
    finally:
        if loaded is not None:
            loaded.close()
    # How the classes' votes grouped answers, where not by exact strings (as sart bench's
    # results.json records it).
    grouping = {} if args.equivalence in (None, "exact") else {"equivalence": args.equivalence}
    document = {"mix": args.mix, **grouping, "rates": documents, "complete": True}
    write_json(path, document)
    if args.json:
        print(json.dumps(document, indent=1))
    console.print(f"wrote {path}")
    return 0


def _mix_rates(
    config: BenchConfig,
    classes: Sequence[Any],
    console: Any,
    serve_rate: Callable[[float, bool], Any] | None,
) -> list[dict[str, Any]]:
    """Each rate's FCFS and priority runs, printed as a table; their JSON documents."""
    from rich import box
    from rich.table import Table

    from sart.bench.mix import mix_json, run_mix

    width = max(c.n for c in classes)
    documents = []
    for rate in config.rates or (None,):
        assert rate is not None and config.num_requests is not None
        if serve_rate is not None:
            runs = [serve_rate(rate, p) for p in (False, True)]
        else:
            assert config.workload
            trace = workload(config.workload).generate(
                config.num_requests, rate, width, config.interval, config.seed
            )
            runs = [run_mix(trace, classes, config, rate, priorities=p) for p in (False, True)]
        table = Table(title=f"Mixed workload at {rate:g} req/s", box=box.SIMPLE_HEAD)
        for name in ("class", "requests", "scheduling", "P50", "P97", "acc %", "req/s"):
            table.add_column(name, justify="left" if name in ("class", "scheduling") else "right")
        for k, klass in enumerate(classes):
            for run in runs:
                stats = run.classes[k]
                acc = "-" if stats.accuracy is None else f"{100 * stats.accuracy:.1f}"
                table.add_row(
                    f"{klass.name} ({klass.method} N={klass.n})",
                    str(stats.requests),
                    run.scheduling,
                    _latency(stats.e2e.p50),
                    _latency(stats.e2e.p97),
                    acc,
                    f"{stats.throughput:.3f}",
                )
        console.print(table)
        documents.append(mix_json(runs, classes, rate))
    return documents


def _latency(seconds: float) -> str:
    """Three significant digits: simulated latencies run to thousands of seconds, the
    testbed's on a CPU to tenths."""
    return f"{seconds:,.0f}" if abs(seconds) >= 100 else f"{seconds:.3g}"


def _on_real_engine(
    args: argparse.Namespace, config: BenchConfig, classes: Sequence[Any]
) -> tuple[Callable[[float, bool], Any], Loaded]:
    """Load ``--engine`` (and the PRM, if a class needs one) once, warm both up, and
    return ``serve(rate, priorities)`` for ``--mix`` on the run's prompts, and what
    was loaded (to close)."""
    from sart.bench.command import REAL_BATCH_SIZE, methods_with_prm, real_setup
    from sart.bench.mix import run_mix_real
    from sart.bench.real import WARMUP_REQUESTS

    setup = real_setup(args, config.batch_size or REAL_BATCH_SIZE)
    equivalence = equivalence_of(setup.equivalence)
    with_prm = methods_with_prm(setup, args.engine, [c.method for c in classes])
    loaded = load(setup.spec, with_prm=bool(with_prm))
    try:
        # One unmeasured pass, so that neither run pays the engine's first-call costs.
        run_mix_real(
            setup.items[:WARMUP_REQUESTS],
            classes,
            loaded.engine,
            loaded.prm,
            config,
            setup.sampling,
            None,
            priorities=False,
            equivalence=equivalence,
        )
    except BaseException:
        loaded.close()
        raise

    def serve(rate: float, priorities: bool) -> Any:
        return run_mix_real(
            setup.items,
            classes,
            loaded.engine,
            loaded.prm,
            config,
            setup.sampling,
            rate,
            priorities=priorities,
            equivalence=equivalence,
        )

    return serve, loaded
