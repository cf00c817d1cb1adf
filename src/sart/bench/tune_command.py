"""The ``sart tune`` command: flags, the printed tables, ``tune.json`` and ``tune.png``.

The search itself is ``sart.bench.tune``; this module turns flags into a
``BenchConfig`` for the simulator and reports what the search found. Every finished
run is logged (``OUT/tune-runs.jsonl``, as ``sart bench`` logs its own), so that an
interrupted tune goes on with ``--resume``: a tune is hundreds of runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from sart.bench.config import DEFAULT_COST_MODEL
from sart.bench.inputs import input_digests
from sart.bench.report import config_json
from sart.bench.results_file import check_not_interrupted, check_writable, write_json
from sart.bench.run_log import TUNE, RecordLog, resumable
from sart.bench.runner import BenchConfig
from sart.bench.tune import (
    INTERVALS,
    PAPER_INTERVAL,
    SLACK,
    Candidate,
    Score,
    Trial,
    TuneResult,
    result_json,
    tune,
)
from sart.errors import ConfigError, needs_extra
from sart.flags import (
    add_cost_model_flag,
    cost_model_from_model,
    default_of,
    fraction,
    in_flags,
    positive_number,
)


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="search SART's N, M, alpha, beta and T on the simulator for a workload and rate",
        description="Run a grid of SART configurations on a tuning trace, keep those as "
        "accurate as Self-Consistency (minus --slack), pick the lowest P97, and compare "
        "it with the paper's defaults and SC on a held-out trace.",
    )
    p.add_argument(
        "--workload",
        default="gaokao",
        metavar="{gaokao,gpqa,FILE.jsonl}",
        help="a workload preset, or a recorded trace to resample requests from (gaokao)",
    )
    add_cost_model_flag(p, "", default=None, shown=DEFAULT_COST_MODEL)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)  # the former spelling
    p.add_argument("--rate", type=positive_number, default=4.0, help="arrival rate, req/s (4)")
    p.add_argument("--n", type=int, nargs="+", default=[4, 8], help="N to search (4 8)")
    p.add_argument(
        "--interval",
        type=int,
        nargs="+",
        default=list(INTERVALS),
        help="the T values to search (200 400 800); with a recorded trace as --workload, "
        "multiples of its T (as the paper's 400 must be)",
    )
    p.add_argument("--requests", type=int, default=200, help="requests per trace (200)")
    p.add_argument("--seed", type=int, default=0, help="the tuning trace's seed (0)")
    p.add_argument("--batch-size", type=int, default=None, help="B (default: sized to KV)")
    replicas = default_of(BenchConfig, "replicas")
    p.add_argument("--replicas", type=int, default=replicas, help=f"engine replicas ({replicas})")
    p.add_argument(
        "--min-accuracy",
        type=fraction,
        default=None,
        help="accuracy a configuration must reach (default: SC's at the same N - --slack)",
    )
    p.add_argument(
        "--slack", type=fraction, default=SLACK, help=f"below SC's accuracy allowed ({SLACK})"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help=f"processes running configurations (default: every core, {os.cpu_count()})",
    )
    p.add_argument("--out", default="sart-tune", help="output directory (sart-tune)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs an interrupted tune of the same options finished in --out "
        "(its tune-runs.jsonl) and run only the rest",
    )
    p.add_argument("--no-plots", action="store_true", help="skip tune.png")
    p.set_defaults(func=run_tune_command)


def run_tune_command(args: argparse.Namespace) -> int:
    try:
        return _tune(args)
    except ConfigError as exc:  # in the words of the flags
        raise in_flags(exc) from None


SCHEMA = "sart.tune/1"


def tune_config(config: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    """What a tune's runs depend on, as ``tune.json`` records it: a resumed tune must
    have been run with the same (``--jobs``, ``--out`` and ``--no-plots`` aside)."""
    return config_json(config) | {
        "intervals": sorted(set(args.interval)),
        "min_accuracy": args.min_accuracy,
        "slack": args.slack,
    }


def _tune(args: argparse.Namespace) -> int:
    if args.model is not None and args.cost_model is None:
        args.cost_model = cost_model_from_model(args.model, "sart tune")
    config = BenchConfig(
        workload=args.workload,
        cost=args.cost_model or DEFAULT_COST_MODEL,
        methods=("sc", "sart"),
        ns=tuple(sorted(set(args.n))),
        rates=(args.rate,),
        num_requests=args.requests,
        batch_size=args.batch_size,
        seed=args.seed,
        replicas=args.replicas,
    )
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs} must be >= 1")
    with needs_extra("sart tune", "bench"):
        from rich.console import Console
    out = Path(args.out)
    path = check_writable(out, "tune.json")  # before any run
    if not args.resume:
        check_not_interrupted(out, TUNE)
    log = RecordLog(out, Trial, TUNE)
    cfg = tune_config(config, args)
    inputs = input_digests(None, config.workload)  # a recorded trace, resampled
    kept = resumable(log, cfg, None, inputs) if args.resume else []
    log.start(kept)
    finished = len(kept)

    def logged(trial: Trial) -> None:
        nonlocal finished
        if finished == len(kept):
            # Written before the first run is logged, not before the tune starts: a tune
            # refused (a bad --interval) leaves the tune.json it found; one stopped from
            # here on, even by SIGKILL, leaves the options its logged runs belong to.
            write_json(path, {"schema": SCHEMA, "complete": False, "config": cfg, "inputs": inputs})
        log.append(trial)
        finished += 1

    console = Console(width=None if Console().is_terminal else 120)
    wall = time.perf_counter()
    try:
        with console.status("tuning (each configuration is one simulated run)"):
            result = tune(
                config,
                args.rate,
                args.n,
                min_accuracy=args.min_accuracy,
                slack=args.slack,
                intervals=args.interval,
                jobs=args.jobs,
                done=kept,
                on_run=logged,
            )
    except KeyboardInterrupt:
        console.print(
            f"interrupted: kept the {finished} finished runs in {log.path}; "
            "the same command with --resume runs only the rest",
            style="bold",
        )
        return 130
    wall = time.perf_counter() - wall
    render(console, result, len(result.tuning) + len(result.tuning_sc) + len(result.held_out))
    flags = json.loads(json.dumps(vars(args) | {"func": None}, default=str))
    data = {
        "schema": SCHEMA,
        "complete": True,
        "config": cfg,
        "inputs": inputs,
        **result_json(result),
    }
    write_json(path, data | {"wall_seconds": wall, "flags": flags})
    written = [path]
    if not args.no_plots:
        written.append(plot(result, out / "tune.png"))
    before = f" (and kept {len(kept)} runs from before)" if kept else ""
    console.print(f"tuned in {wall:.1f} s{before}; wrote {', '.join(str(p) for p in written)}")
    return 0


def render(console: Any, result: TuneResult, runs: int) -> None:
    from rich import box
    from rich.table import Table

    front = Table(
        title=f"Pareto front on the tuning trace ({len(result.tuning)} configurations, "
        f"{runs} runs)",
        box=box.SIMPLE_HEAD,
    )
    for name in ("policy", "acc %", "P97", "tokens/req"):
        front.add_column(name, justify="left" if name == "policy" else "right")
    for s in result.front:
        front.add_row(s.label, f"{100 * s.accuracy:.1f}", f"{s.p97:,.0f}", f"{s.tokens:,.0f}")
    console.print(front)
    held = Table(
        title="Held-out trace (another seed, same workload and rate): accuracy with its 95% "
        "interval, against the floor (SC's held-out accuracy at that N, less the slack)",
        box=box.SIMPLE_HEAD,
    )
    for name in ("policy", "acc % (95% CI)", "floor", "P97", "tokens/req"):
        held.add_column(name, justify="left" if name in ("policy", "floor") else "right")
    for s in result.held_out:
        mark = " (tuned)" if result.winner and s.candidate == result.winner.candidate else ""
        if s.candidate is not None and s.candidate == Candidate.paper(s.n):
            mark += " (paper defaults)"
        floor = (
            f"{100 * result.floors[s.n]:.1f}: {'meets' if result.meets(s) else 'misses'}"
            if s.candidate is not None and s.n in result.floors
            else ""
        )
        held.add_row(s.label + mark, _accuracy(s), floor, f"{s.p97:,.0f}", f"{s.tokens:,.0f}")
    console.print(held)
    console.print(verdict(result))


def _accuracy(score: Score) -> str:
    low, high = score.interval
    return f"{100 * score.accuracy:.1f} ({100 * low:.1f}-{100 * high:.1f})"


def verdict(result: TuneResult) -> str:
    """One line: does the tuned configuration beat the paper's defaults held out? It
    never does while it misses its held-out accuracy floor."""
    if result.winner is None:
        targets = ", ".join(f"N={n}: {100 * t:.1f}%" for n, t in sorted(result.targets.items()))
        return f"no configuration reached its accuracy target ({targets})"
    win = result.winner.candidate
    assert win is not None
    tuned = result.held_out_of(win, win.n)
    paper = result.held_out_of(Candidate.paper(win.n), win.n)
    sc = result.held_out_of(None, win.n)
    floor = result.floors.get(win.n, 0.0)
    against = f"SC {_accuracy(sc)}%, floor {100 * floor:.1f}%"
    if win == Candidate.paper(win.n):
        met = "meet" if result.meets(paper) else "miss"
        return (
            f"the paper's defaults at N={win.n} are already best on the tuning trace; held "
            f"out they {met} the accuracy floor: P97 {paper.p97:,.0f}, accuracy "
            f"{_accuracy(paper)}% ({against})"
        )
    numbers = (
        f"P97 {tuned.p97:,.0f} vs {paper.p97:,.0f} ({paper.p97 / tuned.p97:.2f}x), "
        f"accuracy {_accuracy(tuned)}% vs {_accuracy(paper)}% ({against})"
    )
    if not result.meets(tuned):
        return (
            f"tuned misses the accuracy floor held out ({numbers}): it met it on the tuning "
            f"trace only; keep the defaults ({Candidate.paper(win.n).code()}), or tune on "
            "more --requests"
        )
    if tuned.p97 < paper.p97 and tuned.accuracy >= paper.accuracy:
        return (
            f"tuned meets the accuracy floor and beats the paper's defaults held out: "
            f"{numbers}.\nuse it: {win.code()}"
        )
    return (
        f"tuned meets the accuracy floor but does not beat the paper's defaults held out "
        f"({numbers}): keep the defaults ({Candidate.paper(win.n).code()}), or tune on "
        "more --requests"
    )


def plot(result: TuneResult, path: Path) -> Path:
    """Accuracy against P97 of every tuning run, the front, SC and the winner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sorted({s.n for s in result.tuning}):
        runs = [s for s in result.tuning if s.n == n]
        ax.scatter(
            [s.p97 for s in runs], [100 * s.accuracy for s in runs], s=12, alpha=0.5,
            label=f"SART N={n}",
        )  # fmt: skip
    ax.plot(
        [s.p97 for s in result.front], [100 * s.accuracy for s in result.front], "k-",
        lw=1, label="Pareto front",
    )  # fmt: skip
    for sc in result.tuning_sc:
        ax.scatter([sc.p97], [100 * sc.accuracy], marker="s", s=40, label=f"SC N={sc.n}")
    for n in sorted({s.n for s in result.tuning}):
        paper = _find(result.tuning, Candidate.paper(n))
        if paper is not None:
            ax.scatter([paper.p97], [100 * paper.accuracy], marker="D", s=40, facecolors="none",
                       edgecolors="k", label=f"paper defaults N={n}")  # fmt: skip
    if result.winner is not None:
        ax.scatter([result.winner.p97], [100 * result.winner.accuracy], marker="*", s=150,
                   c="red", label="tuned")  # fmt: skip
    ax.set_xlabel("P97 end-to-end latency (s)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"Tuning trace at {result.rate:g} req/s (T={PAPER_INTERVAL} for SC)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _find(scores: tuple[Score, ...], candidate: Candidate) -> Score | None:
    return next((s for s in scores if s.candidate == candidate), None)
