"""The ``sart bench``, ``sart trace record`` and ``sart trace stats`` commands: flags ->
``BenchConfig`` -> runs -> report.

The flags, their checks and the ``BenchConfig`` they describe are
``sart.bench.parser``'s. Real models load through ``sart.launch`` (the loader
every command shares); ``--mix`` lives in ``sart.bench.mix_command``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import attrs

from sart.bench.parser import (
    REAL_BATCH_SIZE,
    REAL_MAX_TOKENS,
    REAL_TEMPERATURE,
    bench_config,
    requests_of,
)
from sart.bench.real import PolicyFactory, PromptItem
from sart.bench.results_file import ResultsFile, check_output_file, progress_console
from sart.bench.runner import (
    BenchConfig,
    RunRecord,
    method_policy,
    plan,
    run_method,
    traces,
)
from sart.bench.traces import Trace, is_trace_file
from sart.bench.workloads import workload
from sart.errors import ConfigError
from sart.flags import (
    check_name,
    equivalence_of,
    import_plugins,
    in_flags,
    sampling,
)
from sart.launch import LoadSpec, load
from sart.methods import get_method
from sart.model_flags import load_spec
from sart.registry import load_engine, step_engines
from sart.rollouts import rollout_shape, trace_rollouts
from sart.testbed.specs import testbed
from sart.types import SamplingSettings


def record_trace_command(args: argparse.Namespace) -> int:
    trace = workload(args.workload).generate(
        args.requests, args.rate, args.n, args.interval, args.seed
    )
    trace.dump(args.output)
    print(f"wrote {len(trace)} requests x {args.n} branches to {args.output}")
    return 0


def trace_stats_command(args: argparse.Namespace) -> int:
    """``sart trace stats``: ``sart.rollouts.rollout_shape`` of a trace or a workload."""
    if (args.trace is None) == (args.workload is None):
        raise ConfigError("give a trace file or --workload NAME (one of them)")
    if args.trace is not None:
        trace, cap = Trace.load(args.trace), args.max_tokens
    else:
        model = workload(args.workload)
        trace = model.generate(args.requests, 1.0, args.n, 400, args.seed)
        cap = args.max_tokens or model.max_tokens
    shape = rollout_shape(trace_rollouts(trace, cap))
    if args.json:
        print(json.dumps(shape.to_json(), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rollouts of {args.trace or args.workload}")
    for column in ("statistic", "value", "real rollouts"):
        table.add_column(column, justify="left" if column == "statistic" else "right")
    for row in shape.rows():
        table.add_row(*row)
    Console().print(table)
    misfits = shape.misfits()
    print("outside the real ranges: " + "; ".join(misfits) if misfits else "all in the real ranges")
    return 0


def run_bench_command(args: argparse.Namespace) -> int:
    try:
        import_plugins(args.plugin)
        check_name("--engine", args.engine, ["sim", *step_engines()])
        return _bench(args)
    except ConfigError as exc:
        # A recorded trace given as --workload (to resample) loads as a trace does.
        resampled = args.trace is None and is_trace_file(args.workload)
        raise in_flags(exc, {"trace": "--workload"} if resampled else None) from None


def _bench(args: argparse.Namespace) -> int:
    config = bench_config(args)
    if args.mix is not None and args.resume:
        raise ConfigError("--resume: a --mix benchmark starts afresh (leave --resume out)")
    if args.mix is not None:
        from sart.bench.mix_command import bench_mix

        return bench_mix(args, config)
    from sart.bench.inputs import input_digests
    from sart.bench.report import bench_header, report_view, run_json

    # Read once, before any run: what --resume checks a kept run's requests against.
    inputs = input_digests(config.trace, config.workload, getattr(args, "prompts", None))
    console, progress = progress_console("sart bench", to_stderr=args.json)
    out = Path(args.out)
    # Refuses an unwritable --out before any run.
    sink = ResultsFile(
        out,
        config,
        functools.partial(bench_header, inputs=inputs),
        lambda record, gold: run_json(record, gold, config.slo),
        retain=report_view(config, plots=not args.no_plots),
        resume=args.resume,
    )
    try:
        return _serve_and_report(args, config, sink, console, progress)
    finally:
        sink.close()


def _serve_and_report(
    args: argparse.Namespace, config: BenchConfig, sink: ResultsFile, console: Any, progress: Any
) -> int:
    from sart.bench.report import render

    out = Path(args.out)
    try:
        with progress:
            if config.engine == "sim":
                _run_sim(config, progress, sink)
            else:
                _run_real(args, config, progress, sink)
    except KeyboardInterrupt:
        sink.write(complete=False)
        console.print(
            f"interrupted: kept the {len(sink.records)} finished runs in {sink.path}; "
            "the same command with --resume serves only the rest",
            style="bold",
        )
        return 130
    except BaseException:
        sink.flush()  # what finished, up to the failure
        raise
    records, wall = sink.records, sink.elapsed()
    document = sink.write(complete=True)
    plots = []
    if not args.no_plots:
        from sart.bench.plots import write_plots

        plots = write_plots(config, records, out)
    if args.json:
        # Its runs (without requests and timelines) last, after whether it is complete.
        runs = {"runs": document.pop("runs")}
        print(json.dumps(document | runs, indent=1))
    else:
        render(config, records, console)
        kept = f" (and kept {len(sink.kept)} from before)" if sink.kept else ""
        console.print(
            f"ran {_runs(len(records) - len(sink.kept))} in {wall:.1f} s{kept}; wrote "
            + ", ".join(str(p) for p in [out / "results.json", *plots])
        )
    return 0


def _runs(count: int) -> str:
    return f"{count} run" + ("" if count == 1 else "s")


def _run_sim(config: BenchConfig, progress: Any, sink: ResultsFile) -> None:
    workloads = traces(config)
    sink.gold = {rate: trace.gold() for rate, trace in workloads}
    pairs = plan(config)
    done = sink.begin(None, [(rate, m, n) for rate, _ in workloads for m, n in pairs])
    task = progress.add_task("simulating", total=len(workloads) * len(pairs) - len(done))
    for rate, trace in workloads:
        for method, n in pairs:
            if (rate, method, n) in done:
                continue
            where = "trace" if rate is None else f"{rate:g} req/s"
            progress.update(task, description=f"{method} N={n} @ {where}")
            sink.add(run_method(trace, method, n, config, rate))
            progress.advance(task)


@attrs.frozen
class RealSetup:
    """What a real-engine run serves: resolved from the flags (and ``--model testbed``)."""

    spec: LoadSpec
    items: list[PromptItem]
    sampling: SamplingSettings
    equivalence: str = "exact"
    """How votes and agreement stops group answers (``--equivalence``)."""

    def serving(self) -> dict[str, Any]:
        """What was served and how it was sampled: accuracies are not comparable across
        runs without it (a top-p cut changes the testbed's accuracy)."""
        s = self.sampling
        # Said only where not exact: the runs kept before the flag stay resumable.
        grouping = {} if self.equivalence == "exact" else {"equivalence": self.equivalence}
        return (
            grouping
            | self.spec.describe()
            | {
                "sampling": {
                    "temperature": s.temperature,
                    "top_p": s.top_p,
                    "max_tokens": s.max_tokens,
                },
                # Two samplers draw other tokens from the same seeds: --resume keeps them apart.
                "sampler": getattr(load_engine(self.spec.engine), "sampler", None),
            }
        )


def real_setup(args: argparse.Namespace, batch_size: int = REAL_BATCH_SIZE) -> RealSetup:
    """Resolve ``--model``, ``--prm``, ``--prompts`` and sampling defaults.

    ``--model testbed`` (or ``testbed-long``) stands for that shipped testbed's
    policy; its PRM (with the options it is calibrated for) unless ``--prm`` says
    otherwise; and, without ``--prompts``, ``--requests`` of its questions, of
    mixed difficulty, drawn with ``--seed``; sampled at temperature 1.0 and top-p 1.0
    by default (as ``sart testbed report`` samples).
    """
    from sart.bench.real import load_prompts

    bed = testbed(args.model)
    if not args.model or not (args.prompts or bed):
        raise ConfigError(
            f"--engine {args.engine} needs --model PATH and --prompts FILE "
            "(try: sart demo-models DIR), or --model testbed (or testbed-long)"
        )
    spec = load_spec(args, batch_size=batch_size)
    if args.prompts is not None:
        items = load_prompts(args.prompts)
    else:
        assert bed is not None
        items = [
            PromptItem(f"t{i}", q.prompt, q.answer)
            for i, q in enumerate(bed.questions(args.seed, requests_of(args)))
        ]
    sampled = sampling(args, REAL_MAX_TOKENS, REAL_TEMPERATURE)
    return RealSetup(spec, items, sampled, args.equivalence or "exact")


def methods_with_prm(
    setup: RealSetup, engine: str, methods: list[str] | tuple[str, ...]
) -> list[str]:
    """Those of ``methods`` that need the PRM (``ConfigError`` if ``--prm`` gave none)."""
    with_prm = [m for m in methods if get_method(m).needs_prm]
    if with_prm and not setup.spec.prm:
        raise ConfigError(f"--engine {engine} needs --prm PATH for methods {with_prm}")
    return with_prm


def _policies(config: BenchConfig, equivalence: str) -> PolicyFactory | None:
    """Each method's policy, its votes grouping answers under ``--equivalence``
    (``None``: ``run_real``'s default, exact strings)."""
    grouping = equivalence_of(equivalence)
    if grouping is None:
        return None
    return lambda method, n: method_policy(method, n, config.interval, equivalence=grouping)


def _run_real(
    args: argparse.Namespace, config: BenchConfig, progress: Any, sink: ResultsFile
) -> None:
    from sart.bench.real import record_trace, recording_sampling, run_real

    assert config.batch_size is not None and config.rates is not None
    setup = real_setup(args, config.batch_size)
    items = setup.items
    methods_with_prm(setup, args.engine, config.methods)
    if args.record_trace and not setup.spec.prm:
        raise ConfigError("--record-trace needs --prm")
    if args.record_trace:
        check_output_file(Path(args.record_trace), "--record-trace")
    gold = {item.id: item.answer for item in items if item.answer is not None}
    sink.gold = dict.fromkeys(config.rates, gold)
    keys = [(rate, m, n) for rate in config.rates for m, n in plan(config)]
    done = sink.begin(setup.serving(), keys)
    if len(done) == len(keys) and not args.record_trace:
        return  # resumed a finished benchmark: nothing to load
    loading = progress.add_task("loading models", total=None)
    with load(setup.spec) as loaded:
        progress.remove_task(loading)
        task = progress.add_task("serving", total=len(keys) - len(done))

        def finished(record: RunRecord) -> None:
            sink.add(record)
            progress.advance(task)

        run_real(
            items,
            loaded.engine,
            loaded.prm,
            config,
            setup.sampling,
            on_run=finished,
            policy_for=_policies(config, setup.equivalence),
            done=done,
        )
        if args.record_trace:
            trace = record_trace(
                items,
                loaded.engine,
                loaded.prm,
                max(config.ns),
                config.interval,
                recording_sampling(setup.sampling),
                config.rates[0],
                config.seed,
            )
            trace.dump(args.record_trace)
