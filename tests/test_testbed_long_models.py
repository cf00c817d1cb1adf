"""The long testbed's shipped weights: they load, have learned the task, and meet its ranges.

The full calibration report takes 15-30 minutes on a 2-core machine, so the
default suite checks the report shipped beside the weights (``report.json``,
written by ``sart testbed report --model long --json``) and a slow test
(``pytest --slow``) samples it again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from sart.prm.base import ScoreItem
from sart.testbed import LONG
from sart.testbed.tasks import Question, answer_step, clean_trace, join_steps
from sart.types import BranchId

MANIFEST_PATH = LONG.weights / "manifest.json"
REPORT_PATH = LONG.weights / "report.json"


def _manifest() -> dict:
    return json.loads(MANIFEST_PATH.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(LONG.policy_path).eval(),
        AutoTokenizer.from_pretrained(LONG.policy_path),
    )


@pytest.fixture(scope="module")
def prm():
    from sart.prm.hf import QwenMathPRM

    return QwenMathPRM.from_pretrained(LONG.prm_path, **LONG.prm_kwargs())


def test_shipped_files_match_the_manifest() -> None:
    from sart.testbed.recipe import LONG as LONG_CONFIG
    from sart.testbed.train import weight_hashes

    manifest = _manifest()
    assert weight_hashes(LONG.weights) == manifest["sha256"]
    total = sum((LONG.weights / name).stat().st_size for name in manifest["sha256"])
    assert total < 10 * 2**20  # a few MB in the repository
    # What `sart testbed train --model long` trains is what was shipped.
    assert manifest["config"] == LONG_CONFIG.to_json()


def test_shipped_prm_code_is_the_packages_modelling_module() -> None:
    from sart.testbed import modeling_testbed_prm

    shipped = (LONG.prm_path / "modeling_testbed_prm.py").read_text(encoding="utf-8")
    assert shipped == Path(modeling_testbed_prm.__file__).read_text(encoding="utf-8")


@pytest.mark.parametrize("additions", [24, 64])
def test_policy_has_learned_to_copy_and_add(policy, additions: int) -> None:
    # Teacher-forced on clean traces: the argmax after "pK" is digit K (in the
    # prompt or a round back), after "=" the step's sum, on the shortest and the
    # longest cycled questions.
    import random

    from sart.testbed.skills import skills
    from sart.testbed.tasks import make_question

    model, tokenizer = policy
    rng = random.Random(additions)
    questions = [make_question(rng, additions, LONG.cycle) for _ in range(8)]
    copy, add = skills(model, tokenizer, questions)
    assert copy >= 0.9 and add >= 0.9


def test_prm_rates_a_slip_lower_from_where_it_happens(prm) -> None:
    q = Question([6, 6, 1, 9], rounds=6)
    right = clean_trace(q)
    steps = right.split(" \n\n ")
    # A slip at the second addition (6 + 6 = 3, the systematic error "one
    # more"), carried on through every round.
    # Each step carries its round count (``r6 p1 6 + 0 = 6``), as the trace does.
    value, wrong_steps = 0, []
    for k, (marker, i, d) in enumerate(q.walk(), start=1):
        result = (value + d + (1 if k == 2 else 0)) % 10
        wrong_steps.append(f"{marker} p{i} {d} + {value} = {result}")
        value = result
    wrong = join_steps([*wrong_steps, answer_step(value)])
    items = [
        ScoreItem(BranchId("q", i), q.prompt, text, len(text.split()), True)
        for i, text in enumerate([right, wrong])
    ]
    rewards = prm.step_rewards(items)
    assert len(rewards[0]) == len(rewards[1]) == len(steps)
    assert rewards[0][0] == pytest.approx(rewards[1][0], abs=1e-5)
    assert rewards[1][-1] < rewards[0][-1] - 0.1


def test_shipped_report_meets_every_range() -> None:
    from sart.testbed.report import Calibration

    report = Calibration.from_json(json.loads(REPORT_PATH.read_text(encoding="utf-8")))
    assert (report.testbed, report.questions, report.n, report.seed) == ("testbed-long", 200, 8, 0)
    assert report.misfits() == []


@pytest.mark.slow
def test_the_report_samples_what_was_shipped() -> None:
    """Sample the full report again (15-30 minutes) and compare with ``report.json``.

    Identical numbers need the same torch build and CPU kernels as the manifest's;
    elsewhere the new report must still meet every range.
    """
    from sart.testbed.report import Calibration, ReportConfig, calibrate

    shipped = Calibration.from_json(json.loads(REPORT_PATH.read_text(encoding="utf-8")))
    torch.set_num_threads(1)
    ours = calibrate(ReportConfig.of("testbed-long", questions=200))
    if _manifest()["torch"] == torch.__version__:
        assert ours.branch_accuracy == pytest.approx(shipped.branch_accuracy, abs=0.02)
    assert ours.misfits() == []
