"""``sart eval`` end to end: the testbed on the transformers engine (one recorded pass,
every method derived from it; served live for the agreement check), resuming an
interrupted run, refusing other flags, and a MATH-500 subset on tiny random models.

The vLLM run of the same command is in ``tests/test_eval_vllm.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from sart.cli import main
from sart.eval import record as record_module
from sart.eval.accuracy import agreement, tallies, wilson_interval
from sart.eval.command import _Run
from sart.eval.datasets import load_testbed
from sart.eval.problems_file import ProblemsFile
from sart.launch import Loaded

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
LIMIT = 6


def eval_argv(out: Path, *extra: str, limit: int = LIMIT, n: int = 4) -> list[str]:
    # The PRM in this process: its own process costs seconds to start, and is
    # tested by sart bench's testbed runs.
    return [
        "eval",
        "--dataset",
        "testbed",
        "--limit",
        str(limit),
        "--model",
        "testbed",
        "--n",
        *([] if n <= 2 else ["2"]),
        str(n),
        "--prm-in-process",
        "--rate",
        "20",
        "--out",
        str(out),
        *extra,
    ]


def run(argv: list[str]) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(argv)
    return code, printed.getvalue()


def lines(out: Path) -> tuple[dict, list[dict]]:
    header, *problems = (json.loads(x) for x in (out / "problems.jsonl").read_text().splitlines())
    return header, problems


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One ``sart eval`` of 6 testbed questions x 4 branches (and what it printed)."""
    out = tmp_path_factory.mktemp("eval") / "out"
    code, printed = run(eval_argv(out))
    assert code == 0
    return out, printed


def copy(recorded: tuple[Path, str], tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(recorded[0], out)
    return out


class RecordSpy:
    """Wraps ``record_problems``: which problems each call recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[str]] = []
        real = record_module.record_problems

        def spy(items, *args, **kwargs):
            self.calls.append([item.id for item in items])
            return real(items, *args, **kwargs)

        monkeypatch.setattr(record_module, "record_problems", spy)


# ---------------------------------------------------------------------- end to end


def test_every_method_is_derived_from_one_recorded_pass(recorded: tuple[Path, str]) -> None:
    out, printed = recorded
    doc = json.loads((out / "results.json").read_text())
    assert doc["complete"] and doc["mode"] == "derived"
    assert doc["dataset"] | {"source": None} == {
        "name": "testbed",
        "source": None,
        "problems": LIMIT,
        "grading": "exact",
    }
    settings = doc["settings"]
    assert (settings["n"], settings["interval"], settings["chat"]) == (4, 16, False)
    assert (settings["temperature"], settings["top_p"], settings["max_tokens"]) == (1.0, 1.0, 256)
    assert doc["time_unit"] == "seconds (simulated: h100-14b)"
    assert doc["wall_seconds"]["record"] > 0 and doc["wall_seconds"]["serve"] is None
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [
        ("vanilla", 1),
        *((m, n) for m in ("sc", "sart-no-prune", "sart") for n in (2, 4)),
    ]

    # problems.jsonl: the header, then one line per problem; each branch graded exactly.
    header, problems = lines(out)
    assert header["recording"] == settings
    dataset = {p.id: p.answer for p in load_testbed(LIMIT)}
    assert sorted(p["id"] for p in problems) == sorted(dataset)
    recorded_answers = {}
    for line in problems:
        assert line["gold"] == dataset[line["id"]]
        branches = line["trace"]["branches"]
        assert len(branches) == 4 and all(b["length"] >= 1 for b in branches)
        assert line["correct"] == [b["answer"] == line["gold"] for b in branches]
        recorded_answers[line["id"]] = [b["answer"] for b in branches]

    for entry in doc["runs"]:
        requests = entry["requests"]
        assert [r["id"] for r in requests] == list(dataset)  # in the dataset's order
        # Derived grades are those of grading each selected answer again.
        assert [r["correct"] for r in requests] == [
            r["answer"] == dataset[r["id"]] for r in requests
        ]
        assert entry["correct"] == sum(r["correct"] for r in requests)
        assert entry["accuracy"] == entry["correct"] / LIMIT
        assert entry["ci95"] == list(wilson_interval(entry["correct"], LIMIT))
        assert entry["tokens_per_request"] == pytest.approx(
            sum(r["tokens"] for r in requests) / LIMIT
        )
        assert 0 < entry["latency"]["p50"] <= entry["latency"]["p97"]
        assert sum(v["problems"] for v in entry["levels"].values()) == LIMIT
        # The table shows the same numbers.
        low, high = entry["ci95"]
        assert f"{100 * entry['accuracy']:.1f}% ({entry['correct']}/{LIMIT})" in printed
        assert f"{100 * low:.1f}-{100 * high:.1f}%" in printed
    runs = {(r["method"], r["n"]): r for r in doc["runs"]}
    # Vanilla is each problem's first branch; SC at N=4 a most common of the first four.
    assert [r["answer"] for r in runs["vanilla", 1]["requests"]] == [
        recorded_answers[pid][0] for pid in dataset
    ]
    for r in runs["sc", 4]["requests"]:
        counts = Counter(recorded_answers[r["id"]][:4])
        assert counts[r["answer"]] == max(counts.values())
    # Early stopping (M = N/2) spends fewer tokens than waiting for every branch.
    assert runs["sart", 4]["tokens_per_request"] < runs["sc", 4]["tokens_per_request"]
    for plot in ("accuracy_vs_n.png", "accuracy_vs_tokens.png", "accuracy_by_level.png"):
        assert (out / plot).stat().st_size > 0


def test_a_rerun_records_only_the_problems_an_interruption_lost(
    recorded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = copy(recorded, tmp_path)
    path = out / "problems.jsonl"
    text = path.read_text().splitlines(keepends=True)
    kept = "".join(text[:4])  # the header and 3 problems
    path.write_text(kept + text[4][: len(text[4]) // 2])  # and half a line: a cut write
    kept_ids = [json.loads(line)["id"] for line in text[1:4]]
    spy = RecordSpy(monkeypatch)
    code, printed = run(eval_argv(out, "--no-plots"))
    assert code == 0 and "dropped a last line cut short" in printed
    assert len(spy.calls) == 1
    assert sorted(spy.calls[0]) == sorted(
        set(load_testbed(LIMIT).problems[i].id for i in range(LIMIT)) - set(kept_ids)
    )
    assert path.read_text().startswith(kept)
    _, problems = lines(out)
    assert len(problems) == LIMIT and len({p["id"] for p in problems}) == LIMIT
    assert json.loads((out / "results.json").read_text())["complete"]


def test_ctrl_c_keeps_the_finished_problems_and_the_rerun_does_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    argv = eval_argv(out, "--no-plots", limit=3, n=2)
    append = ProblemsFile.append

    def interrupt_after_two(self: ProblemsFile, record) -> None:
        append(self, record)
        if len(self.records) == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(ProblemsFile, "append", interrupt_after_two)
        code, printed = run(argv)
    assert code == 130
    assert "interrupted: 2 of 3 problems are recorded in" in printed
    assert "run the same command again to resume" in printed
    doc = json.loads((out / "results.json").read_text())
    assert not doc["complete"] and doc["runs"] == []
    _, problems = lines(out)
    assert len(problems) == 2
    spy = RecordSpy(monkeypatch)
    code, _ = run(argv)
    assert code == 0
    missing = {"t0", "t1", "t2"} - {p["id"] for p in problems}
    assert spy.calls == [sorted(missing)]
    _, problems = lines(out)
    assert sorted(p["id"] for p in problems) == ["t0", "t1", "t2"]
    assert json.loads((out / "results.json").read_text())["complete"]


def test_ctrl_c_in_a_live_run_does_not_promise_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --live kept its finished runs but said "run the same command again to resume",
    # which serves every run again and replaces them: it says so now.
    from sart.eval import live

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_Run, "load", lambda self: Loaded(None, None))
    monkeypatch.setattr(live, "serve_live", interrupted)
    code, printed = run(eval_argv(tmp_path / "live", "--live", "--no-plots", limit=2, n=2))
    assert code == 130
    assert "kept 0 finished runs in" in printed and "--live does not resume" in printed
    assert "run the same command again to resume" not in printed


def test_other_settings_are_refused_before_anything_is_loaded(
    recorded: tuple[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = copy(recorded, tmp_path)
    before = (out / "problems.jsonl").read_bytes()
    monkeypatch.setattr(_Run, "load", lambda self: pytest.fail("loaded the models"))
    with pytest.raises(SystemExit) as info:
        main(eval_argv(out, "--temperature", "0.5", n=2))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "was recorded with other settings" in err
    assert "--n 4 (this run: 2)" in err and "--temperature 1.0 (this run: 0.5)" in err
    assert (out / "problems.jsonl").read_bytes() == before


def test_a_finished_pass_is_derived_again_without_a_model(
    recorded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another cost model, rate and methods: the simulator only, from the same pass.
    out = copy(recorded, tmp_path)
    monkeypatch.setattr(_Run, "load", lambda self: pytest.fail("loaded the models"))
    argv = eval_argv(out, "--cost-model", "h200-14b", "--methods", "sc", "sart", "--n", "4")
    assert run([*argv, "--no-plots"])[0] == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["time_unit"] == "seconds (simulated: h200-14b)"
    assert doc["wall_seconds"]["record"] is None
    first = {
        (r["method"], r["n"]): r
        for r in json.loads((recorded[0] / "results.json").read_text())["runs"]
    }
    for entry in doc["runs"]:
        assert entry["correct"] == first[entry["method"], entry["n"]]["correct"]
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [("sc", 4), ("sart", 4)]


def test_several_rates_derive_every_method_at_each_as_bench_sweeps_them(
    recorded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --n and --rate mean what they mean in sart bench: N values and rates to sweep.
    out = copy(recorded, tmp_path)
    monkeypatch.setattr(_Run, "load", lambda self: pytest.fail("loaded the models"))
    argv = eval_argv(out, "--methods", "sc", "sart", "--n", "2", "4", "--rate", "1", "64")
    assert run([*argv, "--no-plots"])[0] == 0
    doc = json.loads((out / "results.json").read_text())
    assert (doc["config"]["rates"], doc["config"]["ns"]) == ([1.0, 64.0], [2, 4])
    runs = {(r["method"], r["n"], r["rate"]): r for r in doc["runs"]}
    assert sorted(runs) == sorted(
        (m, n, rate) for m in ("sc", "sart") for n in (2, 4) for rate in (1.0, 64.0)
    )
    for (method, n, _), entry in runs.items():  # the same answers; queueing at 64 req/s
        slow = runs[method, n, 64.0]
        assert entry["correct"] == slow["correct"]
        assert entry["latency"]["p97"] <= slow["latency"]["p97"]


def test_the_old_ns_spelling_still_works_with_a_deprecation_message(
    recorded: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy(recorded, tmp_path)
    argv = eval_argv(out, "--methods", "sc", "--n", "4", "--ns", "2", "--no-plots", "--json")
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "--ns is deprecated: --n takes the N values now" in captured.err
    doc = json.loads(captured.out)
    assert doc["settings"]["n"] == 4  # the recording's N: the same file is reused
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [("sc", 2)]


def test_the_confidence_methods_are_derived_from_the_recorded_logprobs(
    recorded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pass recorded each branch's log-probabilities (per 16 tokens) with its rewards.
    _, problems = lines(recorded[0])
    branches = [b for line in problems for b in line["trace"]["branches"]]
    assert all(b["logprobs"] and b["confidences"] for b in branches)
    out = copy(recorded, tmp_path)
    monkeypatch.setattr(_Run, "load", lambda self: pytest.fail("loaded the models"))
    argv = eval_argv(out, "--methods", "sc", "deepconf", "sart-conf", "--n", "4", "--no-plots")
    assert run(argv)[0] == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["method"], r["n"]) for r in runs] == [("sc", 4), ("deepconf", 4), ("sart-conf", 4)]
    assert all(0.0 < r["accuracy"] <= 1.0 for r in runs)


def test_records_without_logprobs_are_refused_for_the_confidence_methods(
    recorded: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy(recorded, tmp_path)
    path = out / "problems.jsonl"
    header, *problems = (json.loads(x) for x in path.read_text().splitlines())
    for line in problems:  # as an older sart recorded them
        for branch in line["trace"]["branches"]:
            for key in ("logprobs", "confidences", "logprob_every"):
                branch.pop(key, None)
    path.write_text("".join(json.dumps(x) + "\n" for x in [header, *problems]))
    with pytest.raises(SystemExit):
        main(eval_argv(out, "--methods", "deepconf", "--n", "4", "--no-plots"))
    assert "delete it to record again" in capsys.readouterr().err
    assert run(eval_argv(out, "--methods", "sc", "--n", "4", "--no-plots"))[0] == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--n", "0", "4"], "--n [0] must be >= 1"),
        (["--n", "4", "--ns", "8"], "--ns [8] must each be in 1..--n (4)"),
        (["--limit", "0"], "--limit 0 must be >= 1"),
        (["--data", "x.jsonl"], "--data has no effect with --dataset testbed"),
        (["--vllm-arg", "enforce_eager=true"], "--vllm-arg has no effect with --engine hf"),
        (["--sglang-arg", "tp_size=2"], "--sglang-arg has no effect with --engine hf"),
        (["--cost-model", "tpu"], "--cost-model 'tpu' must be one of"),
        (["--rate", "0"], "argument --rate: '0' must be a finite number > 0"),
    ],
)
def test_bad_flags_are_usage_errors(
    tmp_path: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(eval_argv(tmp_path / "out", *extra))
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_jsonl_dataset_needs_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--dataset", "jsonl", "--model", "m", "--prm", "p", "--out", str(tmp_path)])
    assert "--dataset jsonl needs --data FILE" in capsys.readouterr().err
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(SystemExit):
        main(["eval", "--dataset", "jsonl", "--data", missing, "--model", "testbed"])
    assert f"sart: error: --data {missing!r}: no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- served live, compared


def test_served_live_the_accuracies_agree_with_the_derived_ones(
    recorded: tuple[Path, str], tmp_path: Path
) -> None:
    live = tmp_path / "live"
    argv = eval_argv(live, "--live", "--methods", "vanilla", "sc", "sart", "--n", "4")
    assert run([*argv, "--no-plots"])[0] == 0
    doc = json.loads((live / "results.json").read_text())
    assert doc["complete"] and doc["mode"] == "live"
    assert doc["time_unit"] == "seconds (wall clock)"
    assert not (live / "problems.jsonl").exists()
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [("vanilla", 1), ("sc", 4), ("sart", 4)]
    assert doc["wall_seconds"]["serve"] > 0
    derived = json.loads((recorded[0] / "results.json").read_text())
    checks = agreement(tallies(derived), tallies(doc))
    assert [(c.method, c.n) for c in checks] == [("vanilla", 1), ("sc", 4), ("sart", 4)]
    assert all(c.ok for c in checks), checks
    # Branch j of a problem has the same seed in both: Vanilla samples the same branch.
    answers = {r["id"]: r["answer"] for r in derived["runs"][0]["requests"]}
    same = sum(r["answer"] == answers[r["id"]] for r in doc["runs"][0]["requests"])
    assert same >= LIMIT - 1  # batch composition may nudge one sample


# ---------------------------------------------------------- MATH-500 on tiny models


def test_a_math500_subset_runs_on_tiny_random_models(
    demo_models: dict[str, Path], tmp_path: Path
) -> None:
    pytest.importorskip("math_verify")
    data = SHARED_DATA / "math500" / "test.jsonl"
    if not data.is_file():
        pytest.skip(f"{data} is absent: the real benchmark files live beside the project")
    out = tmp_path / "out"
    argv = [
        "eval",
        "--dataset",
        "math500",
        "--data",
        str(data),
        "--limit",
        "3",
        "--model",
        str(demo_models["policy"]),
        "--prm",
        str(demo_models["qwen-prm"]),
        "--n",
        "2",
        "--max-tokens",
        "16",
        "--interval",
        "8",
        "--prm-in-process",
        "--out",
        str(out),
        "--no-plots",
        "--json",
    ]
    code, printed = run(argv)
    assert code == 0
    doc = json.loads(printed)  # --json: the document, without per-request rows
    assert doc["complete"] and doc["dataset"]["grading"] == "math-verify"
    assert doc["settings"]["chat"] is True  # the demo tokenizer has a chat template
    assert doc["settings"]["template"].endswith("put your final answer within \\boxed{}.")
    assert all("requests" not in r for r in doc["runs"])
    # Random weights: accuracy 0 by construction; the point is the path.
    assert [(r["method"], r["n"], r["accuracy"]) for r in doc["runs"]] == [
        ("vanilla", 1, 0.0),
        ("sc", 2, 0.0),
        ("sart-no-prune", 2, 0.0),
        ("sart", 2, 0.0),
    ]
    assert set(doc["runs"][0]["levels"]) <= {"1", "2", "3", "4", "5"}
    _, problems = lines(out)
    golds = [json.loads(x)["answer"] for x in data.read_text().splitlines()[:3]]
    assert [p["gold"] for p in sorted(problems, key=lambda p: int(p["id"]))] == golds
    assert all(len(p["trace"]["branches"]) == 2 for p in problems)
