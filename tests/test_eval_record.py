"""The recorded pass (``sart.eval.record``) on the scripted fake engine: every branch run to
its end and scored every T, graded as it finishes, failures left for a rerun; and
``sart eval``'s handling of them, end to end without a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sart.bench.real import PromptItem
from sart.cli import main
from sart.engines.fake import FakeEngine
from sart.engines.scripts import BranchScript
from sart.eval.command import _Run
from sart.eval.datasets import load_testbed
from sart.eval.grading import ExactGrader
from sart.eval.record import Failure, record_problems
from sart.launch import Loaded
from sart.prm.scripted import ScriptedPRM
from sart.types import SamplingSettings

T = 8


def scripts(answers: dict[str, list[str]]) -> dict[str, list[BranchScript]]:
    """Branch ``j`` answers ``answers[id][j]`` after ``10 + 8 j`` tokens, with a reward per T."""
    return {
        rid: [
            BranchScript(length=10 + 8 * j, answer=a, rewards=(0.3, 0.6, 0.9), final_reward=0.8)
            for j, a in enumerate(branch_answers)
        ]
        for rid, branch_answers in answers.items()
    }


def test_every_branch_runs_to_its_end_and_is_graded_as_its_problem_finishes() -> None:
    answers = {"a": ["1", "2", "1"], "b": ["5", "5", "4"], "c": ["0", "0", "0"]}
    script = scripts(answers)
    engine = FakeEngine(script, fail_prefill={"c"})
    items = [PromptItem(rid, f"question {rid}", gold) for rid, gold in zip("abc", "150")]
    records = []
    failures = record_problems(
        items,
        engine,
        ScriptedPRM(script, every=T),
        ExactGrader(),
        n=3,
        interval=T,
        sampling=SamplingSettings(max_tokens=64),
        batch_size=4,
        on_record=records.append,
    )
    assert [f.id for f in failures] == ["c"] and isinstance(failures[0], Failure)
    assert "injected prefill failure" in failures[0].reason
    by_id = {r.id: r for r in records}
    assert sorted(by_id) == ["a", "b"]
    for rid in by_id:
        record = by_id[rid]
        assert [b.answer for b in record.trace.branches] == answers[rid]
        # No pruning, no early stop: every branch to its scripted end.
        assert [b.length for b in record.trace.branches] == [10, 18, 26]
        # Scored at every T while running: at 8; 8, 16; 8, 16, 24 tokens.
        assert [b.rewards for b in record.trace.branches] == [(0.3,), (0.3, 0.6), (0.3, 0.6, 0.9)]
        assert all(b.final_reward == 0.8 for b in record.trace.branches)
        assert record.correct == tuple(a == record.gold for a in answers[rid])
    assert by_id["a"].correct == (True, False, True) and by_id["a"].gold == "1"


def test_sart_eval_keeps_what_was_recorded_when_a_problem_fails_and_retries_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("rich")
    dataset = load_testbed(3)
    script = scripts({p.id: [p.answer, "x", p.answer, p.answer] for p in dataset})

    def fake_models(failing: set[str]):
        engine = FakeEngine(script, fail_prefill=failing)
        return lambda self: Loaded(engine, ScriptedPRM(script, every=16))

    argv = ["eval", "--dataset", "testbed", "--limit", "3", "--model", "testbed", "--n", "4"]
    argv += ["--out", str(tmp_path / "out"), "--no-plots"]
    monkeypatch.setattr(_Run, "load", fake_models({"t1"}))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "recording failed for 1 problem (t1: prefill failed: injected prefill failure" in err
    assert "run the same command again to retry the failed ones" in err
    path = tmp_path / "out" / "problems.jsonl"
    assert [json.loads(x).get("id") for x in path.read_text().splitlines()[1:]] == ["t0", "t2"]
    assert not json.loads((tmp_path / "out" / "results.json").read_text())["complete"]

    monkeypatch.setattr(_Run, "load", fake_models(set()))
    assert main(argv) == 0
    ids = [json.loads(x)["id"] for x in path.read_text().splitlines()[1:]]
    assert ids == ["t0", "t2", "t1"]
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["complete"]
    # Vanilla takes branch 0, which the script makes right; so do the votes.
    assert all(run["accuracy"] == 1.0 for run in doc["runs"])


def fake_eval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]], *flags: str
) -> dict:
    """``sart eval`` with ``flags`` on the fake engine, branch ``j`` of problem ``id``
    answering ``answers[id][j]``; the results document."""
    script = scripts(answers)
    engine, prm = FakeEngine(script), ScriptedPRM(script, every=T)
    monkeypatch.setattr(_Run, "load", lambda self: Loaded(engine, prm))
    out = tmp_path / "out"
    argv = ["eval", *flags, "--model", "m", "--prm", "p", "--chat", "off", "--interval", str(T)]
    n = [] if "--n" in flags else ["--n", "3"]
    assert main([*argv, *n, "--out", str(out), "--no-plots"]) == 0
    return json.loads((out / "results.json").read_text())


def test_a_math_dataset_is_graded_and_voted_by_meaning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("rich")
    pytest.importorskip("math_verify")
    data = tmp_path / "mine.jsonl"
    rows = [{"id": "half", "problem": "1 - 1/2?", "answer": "\\frac{1}{2}", "level": 1}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The first completed says 3; one half twice, spelled two ways.
    doc = fake_eval(
        tmp_path, monkeypatch, {"half": ["3", "0.5", "\\dfrac{2}{4}"]}, "--dataset", "jsonl",
        "--data", str(data), "--methods", "vanilla", "sc", "--n", "3",
    )  # fmt: skip
    assert doc["dataset"]["grading"] == "math-verify"
    runs = {(r["method"], r["n"]): r for r in doc["runs"]}
    assert runs["vanilla", 1]["requests"][0]["answer"] == "3"
    assert runs["vanilla", 1]["accuracy"] == 0.0
    assert runs["sc", 3]["requests"][0]["answer"] == "0.5"  # a group of two by meaning
    assert runs["sc", 3]["accuracy"] == 1.0
    assert runs["sc", 3]["levels"] == {"1": {"correct": 1, "problems": 1, "accuracy": 1.0}}
    problems = (tmp_path / "out" / "problems.jsonl").read_text().splitlines()[1:]
    assert json.loads(problems[0])["correct"] == [False, True, True]


def test_a_multiple_choice_dataset_is_graded_by_letter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("rich")
    data = tmp_path / "gpqa.csv"
    header = "Record ID,Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,"
    data.write_text(header + "Incorrect Answer 3\nr1,Which?,right,w1,w2,w3\n")
    from sart.eval.datasets import load_dataset

    gold = load_dataset("gpqa-diamond", data).problems[0].answer
    wrong = next(letter for letter in "ABCD" if letter != gold)
    doc = fake_eval(
        tmp_path, monkeypatch, {"r1": [f"({gold})", wrong, f"\\text{{{gold}}}"]},
        "--dataset", "gpqa-diamond", "--data", str(data), "--methods", "vanilla", "sc",
        "--n", "2", "3",
    )  # fmt: skip
    assert doc["dataset"]["grading"] == "choice"
    runs = {(r["method"], r["n"]): r for r in doc["runs"]}
    # The branches' answers are the letters the grader reads from them.
    assert runs["vanilla", 1]["requests"][0]["answer"] == gold
    assert runs["sc", 3]["requests"][0]["answer"] == gold and runs["sc", 3]["accuracy"] == 1.0
    assert runs["sc", 2]["accuracy"] == 1.0  # one each: the first completed wins


def test_a_larger_limit_extends_a_testbed_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The testbed's dataset source named its count (eval_questions(2, 0)), so --limit 3
    # after --limit 2 was refused as other settings, though the docs say a larger --limit
    # extends the recording (as it does for --data and the hub's datasets).
    pytest.importorskip("rich")
    dataset = load_testbed(3)
    script = scripts({p.id: [p.answer, "x"] for p in dataset})
    served: list[str] = []

    def fake_models(self: _Run) -> Loaded:
        served.extend(item.id for item in self.items if item.id not in self.problems.records)
        return Loaded(FakeEngine(script), ScriptedPRM(script, every=16))

    monkeypatch.setattr(_Run, "load", fake_models)
    argv = ["eval", "--dataset", "testbed", "--model", "testbed", "--n", "2", "--no-plots"]
    argv += ["--out", str(tmp_path)]
    assert main([*argv, "--limit", "2"]) == 0
    assert main([*argv, "--limit", "3"]) == 0
    assert served == ["t0", "t1", "t2"]  # t0 and t1 recorded once
    path = tmp_path / "problems.jsonl"
    ids = [json.loads(x).get("id") for x in path.read_text().splitlines()[1:]]
    assert ids == ["t0", "t1", "t2"]
