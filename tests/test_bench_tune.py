"""``sart tune``: the grid, the Pareto front, the choice, held-out reporting, the command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sart
from sart.bench.runner import BenchConfig
from sart.bench.tune import Candidate, Score, choose, pareto, search_space, tune

CONFIG = BenchConfig(methods=("sc", "sart"), ns=(4,), rates=(4.0,), num_requests=30)
SMALL = [
    Candidate.paper(4),
    Candidate(4, 1, 0.5, 2, 400),
    Candidate(4, 2, 0.3, 1, 200),
]


def test_the_grid_holds_the_paper_defaults_and_only_valid_configurations() -> None:
    space = search_space([4, 8])
    assert Candidate.paper(4) in space and Candidate.paper(8) in space
    assert len(space) == len(set(space)) == 108
    assert all(1 <= c.m <= c.n and 1 <= c.beta <= c.n // 2 for c in space)
    with pytest.raises(sart.ConfigError, match="n=1 must be >= 2"):
        search_space([1])


def test_a_candidates_line_of_python_builds_its_policy() -> None:
    candidate = Candidate(8, 6, 0.7, 2, 200)
    built = eval(candidate.code(), {"sart": sart})  # the line the command prints
    assert built == candidate.policy()


scores = st.builds(
    Score,
    candidate=st.none(),
    n=st.just(4),
    p97=st.floats(1, 1000),
    accuracy=st.floats(0, 1),
    tokens=st.just(1.0),
)


@given(st.lists(scores, min_size=1, max_size=30))
def test_the_front_holds_exactly_the_undominated_scores(runs: list[Score]) -> None:
    front = pareto(runs)

    def dominated(s: Score) -> bool:
        return any(
            o.p97 <= s.p97
            and o.accuracy >= s.accuracy
            and (o.p97, o.accuracy) != (s.p97, s.accuracy)
            for o in runs
        )

    assert all(not dominated(s) for s in front)
    kept = {(s.p97, s.accuracy) for s in front}
    assert all((s.p97, s.accuracy) in kept for s in runs if not dominated(s))


def test_the_choice_is_the_fastest_that_reaches_its_target() -> None:
    a = Score(SMALL[0], 4, p97=100.0, accuracy=0.70, tokens=1)
    b = Score(SMALL[1], 4, p97=200.0, accuracy=0.80, tokens=1)
    c = Score(SMALL[2], 4, p97=300.0, accuracy=0.90, tokens=1)
    assert choose([a, b, c], {4: 0.75}) == b
    assert choose([a, b, c], {4: 0.95}) is None


def test_a_tune_is_reproducible_and_reports_the_held_out_trace() -> None:
    first = tune(CONFIG, 4.0, [4], space=SMALL)
    again = tune(CONFIG, 4.0, [4], space=SMALL, jobs=2)  # processes change nothing
    assert first == again
    assert first.winner is not None
    assert first.winner.accuracy >= first.targets[4]
    sc = first.tuning_sc[0]
    assert first.targets[4] == pytest.approx(sc.accuracy - 0.01)
    # Held out: SC and the paper's defaults, then the winner if it is another one.
    labels = [s.label for s in first.held_out]
    assert labels[:2] == ["sc(n=4)", Candidate.paper(4).code()]
    assert first.winner.candidate is not None
    assert first.held_out_of(first.winner.candidate, 4).n == 4
    # Another tuning seed draws other requests: the held-out trace is not the tuning one.
    assert first.held_out[0] != sc


def test_sart_tune_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sart.cli import main

    out = tmp_path / "tune"
    code = main(
        ["tune", "--requests", "30", "--n", "4", "--jobs", "1", "--out", str(out), "--rate", "2"]
    )
    assert code == 0
    data = json.loads((out / "tune.json").read_text())
    assert data["rate"] == 2.0 and len(data["tuning"]) == 54
    assert (out / "tune.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "Held-out trace" in printed
    # The verdict printed agrees with the held-out numbers written: a winner that misses
    # its held-out floor is never recommended; one that meets it and beats the
    # defaults on both P97 and accuracy is.
    winner = data["winner"]
    assert winner is not None
    held = {h["policy"]: h for h in data["held_out"]}
    tuned, paper = held[winner["policy"]], held[Candidate.paper(4).code()]
    if not tuned["meets_floor"]:
        assert "tuned misses the accuracy floor held out" in printed
        assert "use it:" not in printed
    elif tuned["p97"] < paper["p97"] and tuned["accuracy"] >= paper["accuracy"]:
        assert f"use it: {winner['policy']}" in printed.replace("\n", "")
    else:
        assert "does not beat" in printed and "use it:" not in printed


def test_sart_tune_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from sart.cli import main

    with pytest.raises(SystemExit) as info:
        main(["tune", "--jobs", "0"])
    assert info.value.code == 2
    assert "--jobs 0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--n", "1"])
    assert "sart: error: --n 1 must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--slack", "-1"])
    assert "argument --slack: '-1' must be a number in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--rate", "0"])
    assert "argument --rate: '0' must be a finite number > 0" in capsys.readouterr().err


def test_candidates_are_values() -> None:
    assert attrs.evolve(Candidate.paper(8), interval=200) == Candidate(8, 4, 0.5, 4, 200)


@pytest.mark.parametrize(
    ("p97", "accuracy", "paper_accuracy", "said"),
    [
        (50.0, 0.81, 0.80, "meets the accuracy floor and beats"),
        (150.0, 0.81, 0.80, "meets the accuracy floor but does not beat"),
        (50.0, 0.70, 0.80, "misses the accuracy floor"),
        # Faster and more accurate than the defaults, yet below SC held out less the
        # slack: never called better (it met the floor on the tuning trace only).
        (50.0, 0.765, 0.70, "misses the accuracy floor"),
    ],
)
def test_the_verdict_recommends_the_winner_only_if_it_meets_the_floor_and_beats_the_defaults(
    p97: float, accuracy: float, paper_accuracy: float, said: str
) -> None:
    from sart.bench.tune import TuneResult
    from sart.bench.tune_command import verdict

    tuned = Candidate(4, 1, 0.5, 2, 200)
    sc = Score(None, 4, p97=300.0, accuracy=0.815, tokens=1, requests=200)
    paper = Score(Candidate.paper(4), 4, p97=100.0, accuracy=paper_accuracy, tokens=1, requests=200)
    held = Score(tuned, 4, p97=p97, accuracy=accuracy, tokens=1, requests=200)
    win = Score(tuned, 4, p97=1.0, accuracy=0.9, tokens=1, requests=200)
    floors = {4: 0.815 - 0.01}
    result = TuneResult(4.0, {4: 0.5}, (win,), (), (win,), win, (sc, paper, held), floors)
    line = verdict(result)
    assert said in line
    assert ("use it: " + tuned.code() in line) is ("beats" in said and "not" not in said)
    assert "SC 81.5 (" in line  # SC's held-out accuracy, with its 95% interval
    low, high = held.interval
    assert low < accuracy < high and f"{100 * low:.1f}-{100 * high:.1f}" in line


def test_tune_names_the_hardware_with_cost_model_as_bench_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sart.cli import main

    with pytest.raises(SystemExit):
        main(["tune", "--cost-model", "tpu"])
    assert "cost model 'tpu' must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the former spelling of a preset: taken, with a warning
        main(["tune", "--model", "h200-14b", "--workload", "nope"])
    assert "--model h200-14b is deprecated; use --cost-model h200-14b" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # any other model: refused, no advice that would fail
        main(["tune", "--model", "testbed"])
    err = capsys.readouterr().err
    assert "deprecated" not in err
    assert "--model testbed: sart tune runs on the simulator; the simulated hardware" in err


TUNE = ["tune", "--requests", "30", "--n", "4", "--interval", "200", "400", "--no-plots"]


def _report(out: Path) -> dict[str, object]:
    """tune.json less what differs between two invocations of the same tune."""
    document = json.loads((out / "tune.json").read_text())
    return {k: v for k, v in document.items() if k not in ("wall_seconds", "flags")}


def _words(printed: str) -> str:
    return " ".join(printed.split())  # rich wraps long lines where it likes


def test_an_interrupted_tune_resumes_to_the_result_of_an_uninterrupted_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: sart tune had no --resume, and Ctrl-C lost every run an hour of tuning had
    # finished. Now the runs are logged as they finish, the same command with --resume
    # runs only the rest, and the report is the one an uninterrupted tune writes.
    from sart.bench import tune as tuning
    from sart.cli import main

    straight = tmp_path / "straight"
    assert main([*TUNE, "--jobs", "1", "--out", str(straight)]) == 0
    tables = capsys.readouterr().out.split("tuned in")[0]
    runs = len((straight / "tune-runs.jsonl").read_text().splitlines())

    real_run, ran = tuning._run, []

    def interrupted_on_the_sixth(*args: Any) -> Any:
        if len(ran) == 5:
            raise KeyboardInterrupt
        ran.append(args[1])
        return real_run(*args)

    monkeypatch.setattr(tuning, "_run", interrupted_on_the_sixth)
    out = tmp_path / "stopped"
    assert main([*TUNE, "--jobs", "1", "--out", str(out)]) == 130
    said = f"interrupted: kept the 5 finished runs in {out / 'tune-runs.jsonl'}; the same "
    assert said + "command with --resume runs only the rest" in _words(capsys.readouterr().out)
    assert json.loads((out / "tune.json").read_text())["complete"] is False
    log = (out / "tune-runs.jsonl").read_text()
    assert len(log.splitlines()) == 5

    # The same command without --resume would empty the log: refused, as sart bench is.
    with pytest.raises(SystemExit) as info:
        main([*TUNE, "--jobs", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert "holds an interrupted tune (5 finished runs in tune-runs.jsonl): add --resume" in err
    # Another option's runs are not this tune's: refused, naming the option.
    for other, named in [
        (["--seed", "1"], "--seed (config.seed): 0 then, 1 now"),
        (["--slack", "0.02"], "--slack (config.slack): 0.01 then, 0.02 now"),
        (["--interval", "200"], "--interval (config.intervals): [200, 400] then, [200] now"),
    ]:
        with pytest.raises(SystemExit):
            main([*TUNE, *other, "--resume", "--out", str(out)])
        err = capsys.readouterr().err
        assert err.startswith(f"sart: error: --resume: {out} holds another tune (") and named in err
    assert (out / "tune-runs.jsonl").read_text() == log

    monkeypatch.setattr(tuning, "_run", real_run)
    # --jobs is not an option of the tune: its runs are the same in processes.
    assert main([*TUNE, "--jobs", "2", "--resume", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert len((out / "tune-runs.jsonl").read_text().splitlines()) == runs
    assert "(and kept 5 runs from before)" in _words(printed)
    assert printed.split("tuned in")[0] == tables
    assert _report(out) == _report(straight)
    # Resumed once more, a finished tune runs nothing and reports the same.
    ran.clear()
    monkeypatch.setattr(tuning, "_run", lambda *a: ran.append(a[1]) or real_run(*a))
    assert main([*TUNE, "--jobs", "1", "--resume", "--out", str(out)]) == 0
    assert ran == [] and _report(out) == _report(straight)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="signals a process group")
def test_ctrl_c_to_a_tune_in_processes_keeps_what_finished(tmp_path: Path) -> None:
    # Ctrl-C signals the whole foreground group: the tune and its --jobs workers.
    from sart.cli import main

    argv = ["tune", "--requests", "60", "--n", "4", "--interval", "400", "--no-plots"]
    argv += ["--jobs", "2", "--out", str(tmp_path / "stopped")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = "import sys; from sart.cli import main; sys.exit(main(sys.argv[1:]))"
    log = tmp_path / "stopped" / "tune-runs.jsonl"
    with (tmp_path / "stdout").open("w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *argv], env=env, stdout=stdout, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                if log.exists() and len(log.read_text().splitlines()) >= 3:
                    break
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=60) == 130
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    printed = _words((tmp_path / "stdout").read_text())
    kept = len(log.read_text().splitlines())
    assert 3 <= kept and f"interrupted: kept the {kept} finished runs in {log};" in printed
    assert main([*argv, "--resume"]) == 0
    assert main([*argv[:-1], str(tmp_path / "straight")]) == 0
    assert _report(tmp_path / "stopped") == _report(tmp_path / "straight")


@pytest.mark.parametrize(("accuracy", "said"), [(0.9, "they meet the"), (0.5, "they miss the")])
def test_the_verdict_on_the_paper_defaults_winning_says_whether_they_meet_the_floor(
    accuracy: float, said: str
) -> None:
    # It said "held out they misse the accuracy floor" ("misses" less its last letter).
    from sart.bench.tune import TuneResult
    from sart.bench.tune_command import verdict

    paper = Candidate.paper(4)
    win = Score(paper, 4, p97=1.0, accuracy=0.9, tokens=1, requests=200)
    sc = Score(None, 4, p97=300.0, accuracy=0.8, tokens=1, requests=200)
    held = Score(paper, 4, p97=100.0, accuracy=accuracy, tokens=1, requests=200)
    result = TuneResult(4.0, {4: 0.5}, (win,), (), (win,), win, (sc, held), {4: 0.79})
    line = verdict(result)
    assert "the paper's defaults at N=4 are already best on the tuning trace" in line
    assert f"held out {said} accuracy floor: P97 100," in line


def test_resuming_a_tune_refuses_a_resampled_trace_that_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # tune.json held the --workload trace's path only: recorded again under that name,
    # its runs were kept as if the requests were the same.
    from sart.bench import tune as tuning
    from sart.cli import main
    from sart.digests import sha256

    trace = tmp_path / "t.jsonl"
    record = ["trace", "record", str(trace), "--requests", "20", "--n", "4", "--interval", "200"]
    assert main([*record, "--seed", "1"]) == 0
    real_run = tuning._run

    def interrupted_on_the_third(*args: Any) -> Any:
        if len((out / "tune-runs.jsonl").read_text().splitlines()) == 2:
            raise KeyboardInterrupt
        return real_run(*args)

    monkeypatch.setattr(tuning, "_run", interrupted_on_the_third)
    out = tmp_path / "out"
    argv = [*TUNE, "--workload", str(trace), "--jobs", "1", "--out", str(out)]
    assert main(argv) == 130
    document = json.loads((out / "tune.json").read_text())
    assert document["inputs"] == {"--workload": {"path": str(trace), "sha256": sha256(trace)}}
    assert main([*record, "--seed", "2"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--resume"])
    err = capsys.readouterr().err
    assert f"holds another tune (--workload {trace}: the file changed since (sha256 " in err
    assert len((out / "tune-runs.jsonl").read_text().splitlines()) == 2
