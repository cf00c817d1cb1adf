"""The ``sart eval`` command: accuracy, tokens and latency of every method on a benchmark.

By default one recorded pass (``sart.eval.record``) runs each problem's
``--n`` branches to their end with the PRM every ``T`` tokens and appends it
to ``OUT/problems.jsonl`` as it finishes; then every method's answer at every
``N`` is derived from it, and its latency simulated on ``--cost-model``
(``sart.eval.derive``). A run interrupted during the pass resumes, with the
same flags, where it stopped. ``--live`` instead serves every method for real
(``sart.eval.live``). Both print a table and write ``OUT/results.json`` and
plots. The flags and their checks are ``sart.eval.parser``'s.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from sart.bench.command import RealSetup
from sart.bench.real import PolicyFactory, PromptItem, recording_sampling
from sart.bench.results_file import check_writable, progress_console, write_json
from sart.bench.runner import BenchConfig, method_policy, plan
from sart.errors import ConfigError, SartError
from sart.eval.accuracy import EvalRun
from sart.eval.datasets import Dataset, upgrade_recording
from sart.eval.grading import Grader, make_grader
from sart.eval.parser import (
    DEFAULT_INTERVAL,
    EVAL_MAX_TOKENS,
    EVAL_TEMPERATURE,
    PROBLEMS_FILE,
    RECORDING_FLAGS,
    add_eval_parser,
    branch_counts,
    check_flags,
    dataset_of,
)
from sart.eval.problems_file import ProblemRecord, ProblemsFile
from sart.flags import (
    check_name,
    import_plugins,
    in_flags,
    sampling,
)
from sart.launch import Loaded, load
from sart.methods import Rewards, check_methods, get_method
from sart.model_flags import load_spec
from sart.policies.equivalence import Equivalence
from sart.registry import step_engines
from sart.testbed.specs import testbed
from sart.types import Scoring


def run_eval_command(args: argparse.Namespace) -> int:
    try:
        import_plugins(args.plugin)
        check_name("--engine", args.engine, step_engines())
        return _eval(args)
    except ConfigError as exc:
        raise in_flags(exc, {"path": "--data"}) from None


class _Run:
    """What one ``sart eval`` invocation resolved from its flags."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.bed = testbed(args.model)
        check_flags(args)
        self.n, self.ns = branch_counts(args)
        """The N recorded per problem, and the N values reported."""
        self.dataset = dataset_of(args)
        spec = load_spec(args, batch_size=args.batch_size)
        if spec.prm is None:
            raise ConfigError("--prm is needed: the PRM scores every branch every T tokens")
        self.items = [
            PromptItem(p.id, self.dataset.prompt(p), p.answer) for p in self.dataset.problems
        ]
        self.setup = RealSetup(spec, self.items, sampling(args, EVAL_MAX_TOKENS, EVAL_TEMPERATURE))
        self.interval = args.interval or (self.bed.interval if self.bed else DEFAULT_INTERVAL)
        self.methods = check_methods(args.methods)
        self.grader: Grader = make_grader(self.dataset.grading)
        self.equivalence: Equivalence | None = None
        if self.dataset.grading == "math-verify":
            from sart.eval.equivalence import MathVerifyEquivalence

            self.equivalence = MathVerifyEquivalence()
        self.levels = {
            p.id: p.fields["level"] for p in self.dataset.problems if "level" in p.fields
        }
        self.out = Path(args.out)
        self.wall: dict[str, float | None] = {"record": None, "derive": None, "serve": None}
        self.runs: list[EvalRun] = []
        self.settings: dict[str, Any] = {}
        """What generated the branches (model, PRM, sampling, n, T...): results.json's."""
        self.use_chat: bool | None = None
        self.problems: ProblemsFile | None = None
        """``problems.jsonl``, once open."""

    @property
    def recorded(self) -> int:
        """This run's problems found in, or written to, ``problems.jsonl``."""
        records = self.problems.records if self.problems is not None else {}
        return sum(item.id in records for item in self.items)

    def policy_for(self, extract: Callable[[str], str]) -> PolicyFactory:
        def build(method: str, n: int) -> Any:
            return method_policy(
                method, n, self.interval, equivalence=self.equivalence, extract=extract
            )

        return build

    def chat(self) -> bool:
        """Whether prompts go through the model's chat template (``--chat``)."""
        choice = self.args.chat
        if choice != "auto":
            return choice == "on"
        if self.bed:
            return False
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            self.setup.spec.model, trust_remote_code=self.args.trust_remote_code
        )
        return getattr(tokenizer, "chat_template", None) is not None

    def load(self) -> Loaded:
        """The engine and the PRM (close them when done)."""
        return load(attrs.evolve(self.setup.spec, chat=bool(self.use_chat)))

    def document(self, *, complete: bool) -> dict[str, Any]:
        from sart.eval.report import eval_json

        args = self.args
        live = args.live
        config: dict[str, Any] = {
            "methods": list(self.methods),
            "ns": list(self.ns),
            "rate": args.rates[0],
            "rates": list(args.rates),
            "scoring": args.scoring,
            "seed": args.seed,
        }
        if live:
            config["batch_size"] = args.batch_size
            unit = "seconds (wall clock)"
        else:
            config["cost_model"] = args.cost_model
            config["batch_size"] = self.runs[0].record.batch_size if self.runs else None
            unit = (
                "decode steps"
                if args.cost_model == "steps"
                else f"seconds (simulated: {args.cost_model})"
            )
        return eval_json(
            mode="live" if live else "derived",
            dataset={
                "name": self.dataset.name,
                "source": self.dataset.source,
                "problems": len(self.dataset),
                "grading": self.dataset.grading,
            },
            settings=self.settings,
            config=config,
            time_unit=unit,
            wall_seconds=self.wall,
            runs=self.runs,
            levels=self.levels,
            complete=complete,
        )

    def write(self, *, complete: bool) -> dict[str, Any]:
        document = self.document(complete=complete)
        write_json(self.out / "results.json", document)
        return document


def _eval(args: argparse.Namespace) -> int:
    console, progress = progress_console("sart eval", to_stderr=args.json)
    run = _Run(args)
    check_writable(run.out, command="sart eval")  # before any problem is recorded
    started = time.perf_counter()
    try:
        with progress:
            if args.live:
                _live(run, progress)
            else:
                _derived(run, progress, console)
    except KeyboardInterrupt:
        run.write(complete=False)
        console.print(f"interrupted: {_kept(run)}", style="bold", soft_wrap=True)
        return 130
    finally:
        close = getattr(run.equivalence, "close", None)
        if close is not None:
            close()
    document = run.write(complete=True)
    plots = []
    if not args.no_plots:
        from sart.eval.plots import write_plots

        plots = write_plots(run.runs, run.out, run.levels)
    if args.json:
        for entry in document["runs"]:
            entry.pop("requests")
        print(json.dumps(document, indent=1))
        return 0
    from sart.eval.report import render

    mode = (
        "served live (wall clock)"
        if args.live
        else f"derived from one pass, latency simulated on {args.cost_model}"
    )
    unit = "steps" if not args.live and args.cost_model == "steps" else "s"
    title = (
        f"{run.dataset.name}: {len(run.dataset)} problems, {mode}, "
        f"{' '.join(f'{r:g}' for r in args.rates)} req/s, "
        f"T={run.interval}"
    )
    render(run.runs, console, title, unit)
    spent = ", ".join(f"{k} {v:.1f} s" for k, v in run.wall.items() if v is not None)
    console.print(
        f"took {time.perf_counter() - started:.1f} s ({spent}); wrote "
        + ", ".join(str(p) for p in [run.out / "results.json", *plots])
    )
    return 0


def _kept(run: _Run) -> str:
    """What an interrupted run kept, and what running it again does."""
    if not run.args.live:
        recorded = f"{run.recorded} of {len(run.items)} problems are recorded in "
        return f"{recorded}{run.out / PROBLEMS_FILE}; run the same command again to resume"
    # --live does not resume (only the recorded pass does): the same command serves every
    # run again and writes results.json afresh, which this once said it would resume.
    return (
        f"kept {len(run.runs)} finished runs in {run.out / 'results.json'}; --live does not "
        "resume: the same command serves every run again and replaces that file"
    )


def _derived(run: _Run, progress: Any, console: Any) -> None:
    args = run.args
    run.use_chat = run.chat()
    setup = run.setup
    run.settings = {
        "dataset": run.dataset.name,
        "source": run.dataset.source,
        "seed": args.seed,
        "engine": args.engine,
        "model": args.model,
        "prm": args.prm,  # None: the testbed's own
        "prm_kind": args.prm_kind,
        "prm_options": setup.spec.prm_options,
        "chat": run.use_chat,
        "n": run.n,
        "interval": run.interval,
        "temperature": setup.sampling.temperature,
        "top_p": setup.sampling.top_p,
        "max_tokens": setup.sampling.max_tokens,
        "template": run.dataset.template.text,
        "grading": run.dataset.grading,
    }
    path = run.out / PROBLEMS_FILE
    with ProblemsFile(path, run.settings, RECORDING_FLAGS, upgrade_recording) as problems:
        if problems.dropped_partial_line:
            console.print(f"{problems.path}: dropped a last line cut short by an interruption")
        _check_golds(run.dataset, problems.records)
        run.problems = problems
        missing = [item for item in run.items if item.id not in problems.records]
        if missing:
            _record(run, problems, missing, progress)
        records = [problems.records[item.id] for item in run.items]
    _check_logprobs(run, records, problems.path)
    from sart.eval.derive import derive, unboxed

    config = BenchConfig(
        engine="sim",
        trace=str(run.out / PROBLEMS_FILE),
        cost=args.cost_model,
        methods=run.methods,
        ns=run.ns,
        interval=run.interval,
        seed=args.seed,
        scoring=Scoring(args.scoring),
    )
    task = progress.add_task("deriving", total=len(plan(config)) * len(args.rates))
    started = time.perf_counter()

    def finished(eval_run: EvalRun) -> None:
        run.runs.append(eval_run)
        progress.advance(task)

    for rate in args.rates:
        derive(records, config, run.policy_for(unboxed), run.grader, rate=rate, on_run=finished)
    run.wall["derive"] = time.perf_counter() - started


def _check_logprobs(run: _Run, records: Sequence[ProblemRecord], path: Path) -> None:
    """Refuse to derive a confidence method from records that hold no log-probabilities
    (recorded by an older sart): it would replay every branch as equally confident."""
    wanted = sorted(m for m in run.methods if get_method(m).rewards is Rewards.CONFIDENCE)
    bare = [r.id for r in records if any(not b.logprobs for b in r.trace.branches)]
    if wanted and bare:
        raise ConfigError(
            f"methods {wanted} replay the branches' log-probabilities, which {path} does "
            f"not hold for {len(bare)} problems (e.g. {bare[0]!r}: recorded by an older "
            "sart); delete it to record again, or leave those methods out"
        )


def _check_golds(dataset: Dataset, records: dict[str, ProblemRecord]) -> None:
    for problem in dataset:
        record = records.get(problem.id)
        if record is not None and record.gold != problem.answer:
            raise ConfigError(
                f"problem {problem.id!r} was recorded with the gold answer {record.gold!r}, "
                f"but the dataset now says {problem.answer!r}: the dataset changed; give "
                "another --out"
            )


def _record(run: _Run, problems: ProblemsFile, missing: list[PromptItem], progress: Any) -> None:
    from sart.eval.record import record_problems

    loading = progress.add_task("loading models", total=None)
    loaded = run.load()
    progress.remove_task(loading)
    task = progress.add_task(f"recording {len(missing)} problems", total=len(missing))

    def recorded(record: ProblemRecord) -> None:
        problems.append(record)
        progress.advance(task)

    started = time.perf_counter()
    try:
        failures = record_problems(
            missing,
            loaded.engine,
            loaded.prm,
            run.grader,
            n=run.n,
            interval=run.interval,
            sampling=recording_sampling(run.setup.sampling),
            batch_size=run.args.batch_size,
            on_record=recorded,
        )
    finally:
        run.wall["record"] = time.perf_counter() - started
        loaded.close()
    if failures:
        run.write(complete=False)
        listed = "; ".join(f"{f.id}: {f.reason}" for f in failures[:5])
        raise SartError(
            f"recording failed for {len(failures)} "
            f"problem{'s' if len(failures) > 1 else ''} ({listed}); the others are in "
            f"{problems.path}: run the same command again to retry the failed ones"
        )


def _live(run: _Run, progress: Any) -> None:
    from sart.eval.live import serve_live

    args = run.args
    run.use_chat = run.chat()
    run.settings = run.setup.serving() | {"chat": run.use_chat, "n": run.n}
    config = BenchConfig(
        engine=args.engine,
        model=run.setup.spec.model,
        methods=run.methods,
        ns=run.ns,
        rates=tuple(args.rates),
        num_requests=None,
        batch_size=args.batch_size,
        interval=run.interval,
        seed=args.seed,
        scoring=Scoring(args.scoring),
    )
    loading = progress.add_task("loading models", total=None)
    loaded = run.load()
    progress.remove_task(loading)
    task = progress.add_task("serving", total=len(plan(config)) * len(args.rates))

    def finished(eval_run: EvalRun) -> None:
        run.runs.append(eval_run)
        run.wall["serve"] = sum(r.record.summary.makespan for r in run.runs)
        run.write(complete=False)
        progress.advance(task)

    try:
        serve_live(
            run.items,
            loaded.engine,
            loaded.prm,
            config,
            run.setup.sampling,
            run.policy_for(run.grader.extract),
            run.grader,
            on_run=finished,
        )
    finally:
        loaded.close()


__all__ = ["add_eval_parser", "run_eval_command"]
