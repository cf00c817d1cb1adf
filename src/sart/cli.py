"""The ``sart`` command line: ``bench``, ``eval``, ``trace record``, ``quickstart``,
``testbed``, ``serve``, ``tune``."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from sart import __version__
from sart.bench.parser import add_bench_parser, add_trace_parser
from sart.bench.tune_command import add_tune_parser
from sart.engines.fake import FakeEngine
from sart.engines.scripts import random_scripts
from sart.errors import EXTRAS, ConfigError, SartError, install_hint, needs_extra
from sart.eval.parser import add_eval_parser
from sart.flags import check_int_flags
from sart.policies.recipes import sart as sart_policy
from sart.prm.scripted import ScriptedPRM
from sart.request import Request
from sart.results import RequestResult
from sart.serve.command import add_serve_parser
from sart.sync_driver import SyncDriver
from sart.testbed.command import add_parser as add_testbed_parser
from sart.types import BranchStatus, SamplingSettings


def _quickstart(args: argparse.Namespace) -> int:
    for flag in ("requests", "n", "batch_size", "interval", "max_tokens"):
        value = getattr(args, flag)
        if value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value} must be >= 1")
    interval = args.interval
    script = random_scripts(seed=args.seed, median_length=4 * interval, every=interval)
    engine = FakeEngine(script)
    prm = ScriptedPRM(script, every=interval)
    policy = sart_policy(args.n, interval=interval)
    sampling = SamplingSettings(max_tokens=args.max_tokens)
    requests = [
        Request(f"q{i}", f"question {i}", policy, sampling=sampling, arrival=float(i * interval))
        for i in range(args.requests)
    ]
    driver = SyncDriver(engine, prm, batch_size=args.batch_size)
    print(
        f"SART {policy.name} on the fake engine: {args.requests} requests, "
        f"batch budget B={args.batch_size} branches, T={interval} steps; time is in decode steps."
    )
    print(
        f"{'request':<8} {'answer':<7} {'chosen':>6} {'done':>5} {'pruned':>6} {'stopped':>7} "
        f"{'tokens':>7} {'queue':>6} {'e2e':>6}"
    )
    for result in driver.run(requests):
        print(_row(result))
    stats = driver.scheduler.statistics()
    print(
        f"decode steps: {stats.step}, peak live branches: {engine.peak_live}, "
        f"PRM items scored: {prm.items_scored}"
    )
    return 0


def _demo_models(args: argparse.Namespace) -> int:
    with needs_extra("sart demo-models", "hf"):
        from sart.demo_models import build_demo_models
    paths = build_demo_models(args.directory, seed=args.seed)
    for name, path in paths.items():
        print(f"{name:>13}: {path}")
    d = str(args.directory).rstrip("/")  # demo/ is given as often as demo
    print(
        f"try: sart bench --engine hf --model {d}/policy --prm {d}/qwen-prm "
        f"--prompts {d}/prompts.jsonl --rate 4 --n 2 4"
    )
    return 0


def _row(r: RequestResult) -> str:
    stopped = sum(1 for b in r.branches if b.status is BranchStatus.STOPPED)
    t = r.timings
    chosen = r.chosen if r.chosen is not None else "-"
    return (
        f"{r.request_id:<8} {r.answer or '-':<7} {chosen:>6} "
        f"{r.num_completed:>5} {r.num_pruned:>6} {stopped:>7} {r.generated_tokens:>7} "
        f"{t.queueing:>6.0f} {t.end_to_end:>6.0f}"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sart", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sart {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_eval_parser(sub)
    add_trace_parser(sub)
    demo = sub.add_parser(
        "demo-models",
        help="build tiny random transformers models (policy + two PRMs) and a prompt file",
    )
    demo.add_argument("directory", help="where to write them")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo_models)
    quick = sub.add_parser(
        "quickstart",
        help="serve a few requests with SART on the scripted fake engine and print the results",
    )
    quick.add_argument("--requests", type=int, default=6, help="number of requests (default 6)")
    quick.add_argument("--n", type=int, default=8, help="branches per request (default 8)")
    quick.add_argument("--batch-size", type=int, default=16, help="branch budget B (default 16)")
    quick.add_argument("--interval", type=int, default=16, help="T, steps between checks")
    quick.add_argument("--max-tokens", type=int, default=256, help="cap per branch")
    quick.add_argument("--seed", type=int, default=0, help="scenario seed")
    quick.set_defaults(func=_quickstart)
    add_testbed_parser(sub)
    add_serve_parser(sub)
    add_tune_parser(sub)
    return parser


_VLLM_ARGS = (
    "vLLM's engine arguments go through --vllm-arg KEY=VALUE (as in --vllm-arg "
    "tensor_parallel_size=2)"
)
#: An engine -> how its own command line's flags are given to sart.
_PASSED_THROUGH = {
    "vllm": _VLLM_ARGS,
    "vllm-async": _VLLM_ARGS,
    "sglang": "SGLang's server arguments go through --sglang-arg KEY=VALUE (as in "
    "--sglang-arg tp_size=2)",
}


#: The commands that stop on SIGTERM by themselves (``sart serve`` drains its requests).
_OWN_SIGTERM = {"serve"}


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's ``KeyboardInterrupt`` is, so that a command keeps
    and reports its finished work the same way for both."""


@contextlib.contextmanager
def _sigterm_as_interrupt(command: str) -> Iterator[list[int]]:
    """SIGTERM (``kill``, a batch scheduler's time limit, a container stopped) handled as
    Ctrl-C while ``command`` runs: it died at once instead, without the message that says
    what was kept, and ``sart tune``'s worker processes outlived it, blocked, forever.
    Yields a list that holds the signal once one came."""
    came: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        came.append(signum)
        # A second SIGTERM, while the command saves its work, stops it outright.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise _Terminated

    installs = command not in _OWN_SIGTERM and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if installs else None
    try:
        yield came
    finally:
        if installs:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # A vLLM user types vLLM's own flags (--tensor-parallel-size 2): say where they go.
        hint = _PASSED_THROUGH.get(getattr(args, "engine", None) or "")
        flags = any(arg.startswith("--") for arg in unknown)
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)}" + (f"; {hint}" if hint and flags else "")
        )
    with _sigterm_as_interrupt(args.command) as terminated:
        code = _run(parser, args)
    # A command that kept its work returns 130 for an interruption; for SIGTERM, 128 + 15,
    # as a shell reports a process that signal stopped.
    return 128 + signal.SIGTERM if terminated and code == 130 else code


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        check_int_flags(parser, args)  # every command's counts, in one place
        return int(args.func(args))
    except KeyboardInterrupt as exc:
        # Commands that keep partial work (sart bench) say so themselves; the rest
        # end here, without a traceback.
        if isinstance(exc, _Terminated):
            parser.exit(128 + signal.SIGTERM, f"sart: {args.command} terminated\n")
        parser.exit(130, f"sart: {args.command} interrupted\n")
    except SartError as exc:
        parser.exit(2, f"sart: error: {exc}\n")
    except ModuleNotFoundError as exc:
        # Wherever a command first needs an optional extra, say which one to install.
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        needs = f"sart {args.command} needs {exc.name}: {install_hint(extra)}"
        parser.exit(2, f"sart: error: {needs}\n")
    except OSError as exc:
        if exc.filename is None:
            raise
        parser.exit(2, f"sart: error: {exc.filename}: {exc.strerror or exc}\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
