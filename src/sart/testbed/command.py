"""``sart testbed train|report``: reproduce the shipped weights, measure their calibration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sart.errors import needs_extra


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``testbed`` (with ``train`` and ``report``) on the ``sart`` parser."""
    testbed = sub.add_parser(
        "testbed", help="the CPU testbed: a tiny trained reasoning model and PRM"
    )
    actions = testbed.add_subparsers(dest="testbed_command", required=True)
    train = actions.add_parser(
        "train",
        help="train the policy and the PRM from scratch (short: about 8 minutes on 2 cores; "
        "long: about 40)",
    )
    train.add_argument(
        "--out", default="testbed-weights", help="output directory (default testbed-weights)"
    )
    train.add_argument(
        "--model",
        choices=("short", "long"),
        default="short",
        help="which testbed: short (the default; traces of 20-150 tokens) or long "
        "(hundreds to thousands of tokens, over-thinking and loops)",
    )
    train.add_argument(
        "--seed", type=int, default=None, help="default: the shipped weights' (short 0, long 2)"
    )
    train.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: the recipe's, short 1, long 2; hashes depend on it)",
    )
    train.add_argument(
        "--first-stage",
        default=None,
        metavar="DIR",
        help="long: a directory this recipe's first stages trained (OUT/first-stage of "
        "a run, or a run without the last refine stages); its policy is refined instead "
        "of trained again, giving the same weights in the time of the rest",
    )
    train.set_defaults(func=main)
    report = actions.add_parser(
        "report", help="sample N branches per question and print the calibration numbers"
    )
    report.add_argument(
        "--model",
        choices=("short", "long"),
        default="short",
        help="which testbed: short (the default) or long",
    )
    report.add_argument("--n", type=int, default=8, help="branches per question (default 8)")
    report.add_argument(
        "--questions", type=int, default=None, help="questions (default 120; long: 200)"
    )
    report.add_argument("--seed", type=int, default=0)
    report.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    report.add_argument(
        "--weights", help="a directory from 'sart testbed train' (default: shipped)"
    )
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    with needs_extra("sart testbed", "hf"):
        if args.testbed_command == "train":
            import attrs

            from sart.testbed.recipe import TRAIN_CONFIGS
            from sart.testbed.train import train

            config = TRAIN_CONFIGS[args.model]
            seed = config.seed if args.seed is None else args.seed
            threads = config.threads if args.threads is None else args.threads
            config = attrs.evolve(config, seed=seed, threads=threads)
            train(args.out, config, first_stage=args.first_stage)
            return 0
        from sart.testbed.report import ReportConfig, calibrate
        from sart.testbed.specs import TESTBEDS
    weights = Path(args.weights) if args.weights else None
    name = "testbed-long" if args.model == "long" else "testbed"
    questions = args.questions or TESTBEDS[name].report_questions
    result = calibrate(
        ReportConfig.of(name, n=args.n, questions=questions, seed=args.seed),
        policy_dir=weights / "policy" if weights else None,
        prm_dir=weights / "prm" if weights else None,
        threads=args.threads,
    )
    print(json.dumps(result.to_json(), indent=2) if args.json else result.text())
    return 0
