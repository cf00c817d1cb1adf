"""``sart eval``'s flags, their defaults and their checks.

``--n`` and ``--rate`` mean what they mean in ``sart bench``: the ``N`` values
and the arrival rates to sweep (the largest ``N`` is recorded per problem).
The deprecated ``--ns`` keeps its old meaning for a release.
"""

from __future__ import annotations

import argparse
import sys

from sart import flags
from sart.bench.config import DEFAULT_COST_MODEL
from sart.bench.parser import REAL_BATCH_SIZE
from sart.engines.costs import PRESETS
from sart.errors import ConfigError
from sart.eval.datasets import DATASETS, Dataset, load_dataset, load_testbed
from sart.launch import TESTBED_INTERVAL
from sart.model_flags import add_model_flags
from sart.testbed.specs import LONG
from sart.types import SamplingSettings

DATASET_CHOICES = (*DATASETS, "testbed", "testbed-long")
TESTBED_LIMIT = {"testbed": 40, "testbed-long": 200}
"""Testbed questions when ``--limit`` is not given (a testbed has no fixed set)."""
EVAL_MAX_TOKENS = 32768
"""Tokens per branch by default: room for a reasoning model's whole answer."""
EVAL_TEMPERATURE: float = flags.default_of(SamplingSettings, "temperature")
"""DeepSeek-R1's recommended sampling temperature for reasoning (the library's own)."""
DEFAULT_METHODS = ("vanilla", "sc", "sart-no-prune", "sart")
DEFAULT_N = 8
DEFAULT_INTERVAL = 400
PROBLEMS_FILE = "problems.jsonl"

#: The recording's settings -> the flags that set them, for the refusal to resume.
RECORDING_FLAGS = {
    "dataset": "--dataset",
    "source": "--data",
    "seed": "--seed",
    "engine": "--engine",
    "model": "--model",
    "prm": "--prm",
    "prm_kind": "--prm-kind",
    "prm_options": "the PRM's options",
    "chat": "--chat",
    "n": "--n",
    "interval": "--interval",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "max_tokens": "--max-tokens",
    "template": "the prompt template",
    "grading": "the grader",
}


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="accuracy, tokens and latency of every method on a benchmark (MATH-500, "
        "AIME, GPQA-Diamond, your JSONL, the testbed), from one recorded pass",
        description="Record one pass (every branch to its end, the PRM every T tokens; "
        "resumable), derive every method's answer at every N from it, with latencies "
        "simulated on a cost model; or, with --live, serve every method for real. Prints "
        "a table, writes results.json, problems.jsonl and plots.",
    )
    p.add_argument(
        "--dataset",
        required=True,
        choices=DATASET_CHOICES,
        help="the benchmark: graded by math-verify (math500, aime2024, aime2025, jsonl), by "
        "option letter (gpqa-diamond) or exactly (testbed, testbed-long: a shipped testbed's "
        "questions)",
    )
    p.add_argument(
        "--data",
        help="a local JSONL (or GPQA CSV) file of the dataset (default: the Hugging Face hub, "
        "through `datasets`; jsonl: required)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="the first K problems only (default: all; testbed: "
        f"{TESTBED_LIMIT['testbed']}; testbed-long: {TESTBED_LIMIT['testbed-long']})",
    )
    p.add_argument(
        "--engine",
        default="hf",
        help="hf: transformers (default); vllm: vLLM in this process (sart[vllm]); "
        "sglang: SGLang in this process (sart[sglang])",
    )
    p.add_argument(
        "--model",
        required=True,
        help="the policy's directory or hub id, or 'testbed' / 'testbed-long' (a shipped "
        "tiny reasoning model, with its PRM by default)",
    )
    add_model_flags(p)
    flags.add_sampling_flags(p, "", EVAL_MAX_TOKENS, EVAL_TEMPERATURE)
    flags.add_plugin_flag(p)
    p.add_argument(
        "--chat",
        choices=["auto", "on", "off"],
        default="auto",
        help="put prompts through the model's chat template: auto (default) does when its "
        "tokenizer has one (never for the testbed)",
    )
    p.add_argument(
        "--n",
        type=int,
        nargs="+",
        default=None,
        help="branches per request: the N values to report, as in sart bench (default: 2, "
        f"4, 8... up to {DEFAULT_N}); the largest is recorded per problem, and the others "
        "are derived from it. Vanilla is N = 1",
    )
    p.add_argument("--ns", type=int, nargs="+", default=None, help=argparse.SUPPRESS)
    flags.add_methods_flag(p, "evaluate", DEFAULT_METHODS, default=list(DEFAULT_METHODS))
    p.add_argument(
        "--interval",
        type=int,
        default=None,
        help=f"T, tokens between PRM checks (default {DEFAULT_INTERVAL}; testbed: "
        f"{TESTBED_INTERVAL}; testbed-long: {LONG.interval})",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=REAL_BATCH_SIZE,
        help=f"the real engine's branch budget B (default {REAL_BATCH_SIZE}); the simulator "
        "sizes its own to the cost model",
    )
    flags.add_cost_model_flag(
        p, "derived latencies: ", default=DEFAULT_COST_MODEL, shown=DEFAULT_COST_MODEL
    )
    p.add_argument(
        "--rate",
        type=flags.positive_number,
        nargs="+",
        default=[1.0],
        dest="rates",
        help="arrival rates in requests/s, as in sart bench: requests arrive as a Poisson "
        "process at each (default 1), simulated or, with --live, real",
    )
    flags.add_scoring_flag(p)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the testbed's questions, GPQA's option order and the arrivals",
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="serve every method for real, one after the other (wall-clock latency, each "
        "method generating its own branches), instead of deriving them from one pass",
    )
    flags.add_output_flags(p, "sart-eval", "the results JSON (without per-request rows)")
    p.set_defaults(func=_run)


def check_flags(args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    if args.interval is not None and args.interval < 1:
        raise ConfigError(f"--interval {args.interval} must be >= 1")
    if args.cost_model not in PRESETS:
        raise ConfigError(f"--cost-model {args.cost_model!r} must be one of {sorted(PRESETS)}")


def dataset_of(args: argparse.Namespace) -> Dataset:
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit} must be >= 1")
    if args.dataset in TESTBED_LIMIT:
        if args.data is not None:
            raise ConfigError(
                f"--data has no effect with --dataset {args.dataset} (its questions are made)"
            )
        return load_testbed(args.limit or TESTBED_LIMIT[args.dataset], args.seed, args.dataset)
    if args.dataset == "jsonl" and args.data is None:
        raise ConfigError("--dataset jsonl needs --data FILE")
    return load_dataset(args.dataset, args.data, seed=args.seed, limit=args.limit)


def branch_counts(args: argparse.Namespace) -> tuple[int, tuple[int, ...]]:
    """The N recorded per problem and the N values reported: ``--n``'s (the largest
    recorded), or 2, 4, 8... up to the default. The deprecated ``--ns`` keeps its
    old meaning: the values reported, with ``--n`` (one value) the N recorded."""
    given = args.n
    if args.ns is not None:
        print(
            "sart eval: --ns is deprecated: --n takes the N values now (--n 4 8 reports "
            "N = 4 and 8 and records 8)",
            file=sys.stderr,
        )
        if given is not None and len(given) > 1:
            raise ConfigError(f"--n {given} must be one value with the deprecated --ns")
        recorded = given[0] if given else DEFAULT_N
        reported = args.ns
    elif given is not None:
        recorded, reported = max(given), given
    else:
        recorded, reported = DEFAULT_N, [2**k for k in range(1, 8) if 2**k <= DEFAULT_N]
    small = sorted({n for n in [*(given or []), *reported] if n < 1})
    if small:
        raise ConfigError(f"--n {small} must each be >= 1")
    if args.ns is not None:
        bad = [n for n in reported if n > recorded]
        if bad:
            raise ConfigError(f"--ns {bad} must each be in 1..--n ({recorded})")
        return recorded, tuple(sorted(set(reported)))
    return recorded, tuple(sorted({*reported, recorded}))


def _run(args: argparse.Namespace) -> int:
    from sart.eval.command import run_eval_command

    return run_eval_command(args)
