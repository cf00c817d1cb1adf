"""Every method at every N from one recorded pass (``sart.eval.derive``), the per-problem
file it reads (``ProblemsFile``: resumable, refuses other settings), accuracy intervals
and the derived-vs-live agreement check. No models: recordings are written by hand."""

from __future__ import annotations

import json
import math
from importlib.util import find_spec
from pathlib import Path

import attrs
import pytest

from sart.bench.runner import BenchConfig, method_policy, run_method
from sart.bench.traces import Trace, TraceRequest
from sart.engines.scripts import BranchScript
from sart.errors import ConfigError
from sart.eval.accuracy import Tally, agreement, tallies, wilson_interval
from sart.eval.derive import derive, replay_trace, unboxed
from sart.eval.grading import ExactGrader, grade_answer, make_grader
from sart.eval.problems_file import SCHEMA, ProblemRecord, ProblemsFile
from sart.policies.equivalence import ExactMatch
from sart.policies.recipes import self_consistency
from sart.policies.select import BestReward, MajorityVote, WeightedVote
from sart.policies.stop import Agreement

needs_math_verify = pytest.mark.skipif(
    find_spec("math_verify") is None, reason="math-verify is not installed (sart[eval])"
)


def problem(
    pid: str, gold: str, answers: list[str], lengths: list[int] | None = None, grader=None
) -> ProblemRecord:
    """A recorded problem whose branch ``j`` answers ``answers[j]`` after ``lengths[j]``
    tokens; rewards favour the later branches."""
    lengths = lengths or [10 * (j + 1) for j in range(len(answers))]
    branches = tuple(
        BranchScript(length=n, answer=a, rewards=(0.6,), final_reward=0.5 + 0.05 * j, filler="")
        for j, (a, n) in enumerate(zip(answers, lengths))
    )
    trace = TraceRequest(pid, 0.0, gold, branches, prompt_tokens=16, interval=8)
    grader = grader or ExactGrader()
    return ProblemRecord(pid, gold, trace, [grade_answer(grader, a, gold) for a in answers])


def sim_config(**fields) -> BenchConfig:
    fields = {"methods": ("vanilla", "sc"), "ns": (3,), "interval": 8, **fields}
    return BenchConfig(engine="sim", trace="recorded", cost="steps", **fields)


def exact_policies(method: str, n: int):
    return method_policy(method, n, 8, extract=unboxed)


# ----------------------------------------------------------------------- derive


def test_vanilla_is_branch_0_and_a_vote_counts_the_first_n_branches() -> None:
    records = [
        problem("a", "7", ["1", "7", "7", "2"]),  # N=3: 7 wins 2 to 1; vanilla says 1
        problem("b", "5", ["5", "4", "3", "3"]),  # N=3: three answers, the first (5) wins
    ]
    runs = derive(records, sim_config(), exact_policies, ExactGrader(), rate=10.0)
    by = {(r.method, r.n): r for r in runs}
    assert [r.answer for r in by["vanilla", 1].record.results] == ["1", "5"]
    assert by["vanilla", 1].correct == (False, True)
    assert [r.answer for r in by["sc", 3].record.results] == ["7", "5"]
    assert by["sc", 3].correct == (True, True)
    # The fourth branch was recorded, but N = 3 never sees it.
    assert all(len(r.branches) == 3 for r in by["sc", 3].record.results)
    assert by["sc", 3].tokens_per_request == (10 + 20 + 30) * 2 / 2


def test_derived_grades_are_those_of_grading_the_selected_answer_again() -> None:
    grader = ExactGrader()
    records = [problem(f"p{i}", str(i % 3), [str((i + j) % 3) for j in range(4)]) for i in range(9)]
    config = sim_config(methods=("vanilla", "sc", "sart-no-prune", "sart"), ns=(2, 4))
    for run in derive(records, config, exact_policies, grader, rate=5.0):
        gold = {r.id: r.gold for r in records}
        regraded = tuple(
            grade_answer(grader, r.answer, gold[r.request_id]) for r in run.record.results
        )
        assert run.correct == regraded, (run.method, run.n)


@needs_math_verify
def test_votes_group_answers_by_meaning_when_given_math_verify() -> None:
    from sart.eval.equivalence import MathVerifyEquivalence

    grader = make_grader("math-verify")
    # One half in two spellings outvotes the 3 that completed first.
    records = [problem("q", "\\frac{1}{2}", ["3", "\\frac12", "0.5"], grader=grader)]
    assert records[0].correct == (False, True, True)
    config = sim_config(methods=("sc",))
    exact = derive(records, config, exact_policies, grader, rate=1.0)
    assert exact[0].record.results[0].answer == "3" and exact[0].correct == (False,)

    def by_meaning(method: str, n: int):
        return method_policy(method, n, 8, equivalence=MathVerifyEquivalence(), extract=unboxed)

    meaning = derive(records, config, by_meaning, grader, rate=1.0)
    assert meaning[0].record.results[0].answer == "\\frac12" and meaning[0].correct == (True,)


def test_replayed_arrivals_are_a_poisson_process_whose_prefix_does_not_depend_on_k() -> None:
    records = [problem(f"p{i}", "1", ["1"]) for i in range(6)]
    six = [r.arrival for r in replay_trace(records, 2.0, seed=3)]
    four = [r.arrival for r in replay_trace(records[:4], 2.0, seed=3)]
    assert six[:4] == four and six == sorted(six) and six[0] > 0


def test_unboxed_reads_back_any_answer_the_simulator_wrote() -> None:
    for answer in ["", "7", "\\frac{1}{2}", "{", "a}b", "x\ny"]:
        text = BranchScript(length=1, answer=answer, filler="").text_span(0, 1)
        assert unboxed(text) == answer


def test_method_policy_sets_the_votes_equivalence_and_leaves_the_rest() -> None:
    class Loose(ExactMatch):
        pass

    sc = method_policy("sc", 4, 8, equivalence=Loose(), extract=str.upper)
    assert isinstance(sc.select, MajorityVote) and isinstance(sc.select.equivalence, Loose)
    assert sc.extract is str.upper and sc.n == 4 and sc.interval == 8
    rebase = method_policy("rebase", 4, 8, equivalence=Loose())
    assert isinstance(rebase.select, WeightedVote) and isinstance(rebase.select.equivalence, Loose)
    sart = method_policy("sart", 4, 8, equivalence=Loose())
    assert isinstance(sart.select, BestReward)
    # An agreement stop groups answers as the votes do.
    rebranch = method_policy("sart-rebranch", 8, 8, equivalence=Loose())
    assert isinstance(rebranch.stop, Agreement) and isinstance(rebranch.stop.equivalence, Loose)
    assert isinstance(rebranch.select.equivalence, Loose)
    # Without options it is the bench's recipe, unchanged.
    assert method_policy("sc", 4, 8) == self_consistency(4, interval=8)


def test_run_method_serves_the_policy_it_is_given() -> None:
    records = [problem("a", "7", ["1", "7", "7"])]
    trace = Trace.of(r.trace for r in records)
    config = sim_config(methods=("sc",))
    default = run_method(trace, "sc", 3, config)
    assert default.results[0].answer == "7"
    first = method_policy("sc", 3, 8)
    first = attrs.evolve(first, select=BestReward())  # the last-completed has the best reward
    assert run_method(trace, "sc", 3, config, policy=first).results[0].answer == "7"
    assert run_method(trace, "sc", 3, config, policy=first).results[0].chosen == 2


# ------------------------------------------------------------------- the problems file

RECORDING = {"dataset": "testbed", "n": 3, "interval": 8, "temperature": 1.0}


def test_problems_file_appends_whole_lines_and_reads_them_back(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    with ProblemsFile(path, RECORDING) as f:
        f.append(problem("a", "7", ["1", "7", "7"]))
        f.append(problem("b", "5", ["5", "4", "3"]))
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"schema": SCHEMA, "recording": RECORDING}
    assert [json.loads(line)["id"] for line in lines[1:]] == ["a", "b"]
    with ProblemsFile(path, RECORDING) as again:
        assert list(again.records) == ["a", "b"] and not again.dropped_partial_line
        assert again.records["a"] == problem("a", "7", ["1", "7", "7"])
        with pytest.raises(ConfigError, match="'a' is already in"):
            again.append(problem("a", "7", ["1"]))


def test_a_last_line_cut_short_is_dropped_and_the_file_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    with ProblemsFile(path, RECORDING) as f:
        f.append(problem("a", "7", ["1", "7", "7"]))
    whole = path.read_bytes()
    cut = json.dumps(problem("b", "5", ["5", "4", "3"]).to_json())[:40]
    path.write_bytes(whole + cut.encode())
    with ProblemsFile(path, RECORDING) as f:
        assert f.dropped_partial_line and list(f.records) == ["a"]
        f.append(problem("b", "5", ["5", "4", "3"]))
    assert path.read_bytes().startswith(whole)
    assert list(ProblemsFile(path, RECORDING).records) == ["a", "b"]


def test_a_damaged_line_that_is_not_the_last_is_refused_with_its_place(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    with ProblemsFile(path, RECORDING) as f:
        f.append(problem("a", "7", ["1", "7", "7"]))
        f.append(problem("b", "5", ["5", "4", "3"]))
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:30] + "\n" + lines[2])
    with pytest.raises(ConfigError, match=r"problems\.jsonl:2: not JSON"):
        ProblemsFile(path, RECORDING)


def test_other_settings_are_refused_naming_each_difference(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    ProblemsFile(path, RECORDING).close()
    other = RECORDING | {"n": 4, "temperature": 0.6}
    with pytest.raises(ConfigError) as info:
        ProblemsFile(path, other, {"n": "--n", "temperature": "--temperature"})
    message = str(info.value)
    assert "--n 3 (this run: 4)" in message and "--temperature 1.0 (this run: 0.6)" in message
    assert "dataset" not in message and "give another --out" in message
    (tmp_path / "other.jsonl").write_text('{"some": "file"}\n')
    with pytest.raises(ConfigError, match="not a sart eval recording"):
        ProblemsFile(tmp_path / "other.jsonl", RECORDING)


# ----------------------------------------------------------------- intervals, agreement


def test_wilson_interval_known_values_and_edges() -> None:
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and low == pytest.approx(0.7225, abs=1e-4)
    low, high = wilson_interval(50, 100)
    assert (low, high) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_agreement_tolerates_sampling_noise_and_flags_more() -> None:
    derived = [Tally("sc", 4, 80, 100), Tally("sart", 4, 85, 100), Tally("vanilla", 1, 60, 100)]
    live = [Tally("sc", 4, 84, 100), Tally("sart", 4, 60, 100)]
    checks = {(a.method, a.n): a for a in agreement(derived, live)}
    assert set(checks) == {("sc", 4), ("sart", 4)}  # vanilla was not served live
    assert checks["sc", 4].ok and checks["sc", 4].difference == pytest.approx(0.04)
    pooled = (80 + 84) / 200
    assert checks["sc", 4].tolerance == pytest.approx(
        3 * math.sqrt(2 * pooled * (1 - pooled) / 100)
    )
    assert not checks["sart", 4].ok
    # At 100% both ways the spread is 0: a floor of one problem remains.
    (same,) = agreement([Tally("sc", 2, 10, 10)], [Tally("sc", 2, 10, 10)])
    assert same.ok and same.tolerance == pytest.approx(0.1)
    doc = {"runs": [{"method": "sc", "n": 4, "correct": 80, "problems": 100, "other": 1}]}
    assert tallies(doc) == [Tally("sc", 4, 80, 100)]


def test_a_testbed_recording_that_named_its_count_resumes(tmp_path: Path) -> None:
    # Before 88a4011 a testbed's source named its question count; a recording made then
    # resumes (the count left out), one of another seed is still refused.
    from sart.eval.datasets import upgrade_recording

    path = tmp_path / "problems.jsonl"
    then = RECORDING | {"source": "sart.testbed.LONG.eval_questions(200, 0)"}
    with ProblemsFile(path, then) as f:
        f.append(problem("a", "7", ["1", "7", "7"]))
    now = RECORDING | {"source": "sart.testbed.LONG.eval_questions(seed=0)"}
    with ProblemsFile(path, now, upgrade=upgrade_recording) as f:
        assert list(f.records) == ["a"]
    other = RECORDING | {"source": "sart.testbed.LONG.eval_questions(seed=1)"}
    with pytest.raises(ConfigError, match=r"eval_questions\(seed=0\)\" \(this run"):
        ProblemsFile(path, other, upgrade=upgrade_recording)
