"""The ``sart`` command line: missing extras and unwritable files end in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from sart.cli import main


def test_a_missing_extra_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # Before: `sart demo-models` without torch ended in a raw ModuleNotFoundError.
    import sart.demo_models

    def needs_torch(*args: object, **kwargs: object) -> None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(sart.demo_models, "build_demo_models", needs_torch)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo-models", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "sart demo-models needs torch: pip install -e '.[hf]'" in capsys.readouterr().err


def test_an_unrelated_missing_module_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    import sart.demo_models

    def broken(*args: object, **kwargs: object) -> None:
        raise ModuleNotFoundError("No module named 'sart.typo'", name="sart.typo")

    monkeypatch.setattr(sart.demo_models, "build_demo_models", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["demo-models", "x"])


@pytest.mark.parametrize("where", ["a directory", "a missing parent"])
def test_trace_record_into_an_unwritable_path_is_one_line(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Before: a raw IsADirectoryError / FileNotFoundError traceback.
    target = tmp_path if where == "a directory" else tmp_path / "no" / "such" / "t.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "record", str(target), "--requests", "5"])
    assert exit_info.value.code == 2
    assert f"sart: error: {target}" in capsys.readouterr().err


def test_ctrl_c_in_any_command_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # Before: a KeyboardInterrupt traceback (sart bench says what it kept, itself).
    import sart.demo_models

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sart.demo_models, "build_demo_models", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo-models", str(tmp_path)])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == "sart: demo-models interrupted\n"


class _Unhandled(Exception):
    """Raised by the test's own SIGTERM handler: the command left SIGTERM to it."""


def test_sigterm_keeps_a_benchmarks_finished_runs_as_ctrl_c_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # Before: SIGTERM (kill, a scheduler's time limit) stopped sart at once, exit -15,
    # without saying what it kept; now it is taken as Ctrl-C, exit 143.
    import json
    import os
    import signal

    from sart.bench import command

    real_run, served = command.run_method, []

    def term_after_the_first(*args: object) -> object:
        if served:
            os.kill(os.getpid(), signal.SIGTERM)
        served.append(args[1:3])
        return real_run(*args)

    def unhandled(signum: int, frame: object) -> None:
        raise _Unhandled

    monkeypatch.setattr(command, "run_method", term_after_the_first)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        argv = ["bench", "--requests", "6", "--rate", "2", "--n", "2", "--no-plots"]
        code = main([*argv, "--methods", "sc", "sart", "--out", str(tmp_path)])
        assert signal.getsignal(signal.SIGTERM) is unhandled  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143
    assert "interrupted: kept the 1 finished runs" in capsys.readouterr().out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert not doc["complete"] and [r["method"] for r in doc["runs"]] == ["sc"]


def _children(pid: int) -> set[int]:
    import os

    children: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children |= {int(c) for c in f.read().split()}
    return children


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_sigterm_to_tune_stops_its_worker_processes(tmp_path: Path) -> None:
    # Before: SIGTERM to sart tune alone (kill PID) killed it and left its --jobs workers
    # orphaned, asleep forever; now they are stopped as with Ctrl-C, and the runs that
    # finished are kept for --resume.
    import os
    import signal
    import subprocess
    import sys
    import time

    argv = ["tune", "--requests", "100", "--n", "4", "--jobs", "2", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = "import sys; from sart.cli import main; sys.exit(main(sys.argv[1:]))"
    # stderr to a file: orphaned workers would hold a pipe open past the parent's end.
    stderr, stdout = (tmp_path / "stderr").open("w"), (tmp_path / "stdout").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *argv], env=env, stderr=stderr, stdout=stdout
    )
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            workers = {c for c in _children(proc.pid) if _alive(c)}
            time.sleep(0.1)
        time.sleep(1.0)  # the workers at work
        workers = {c for c in _children(proc.pid) if _alive(c)}
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        err = (tmp_path / "stderr").read_text()
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers and not [w for w in workers if _alive(w)]
        assert proc.returncode == 143 and err == ""
        kept = len((tmp_path / "tune-runs.jsonl").read_text().splitlines())
        printed = " ".join((tmp_path / "stdout").read_text().split())
        assert (
            f"interrupted: kept the {kept} finished runs in {tmp_path / 'tune-runs.jsonl'}"
            in printed
        )
    finally:
        stderr.close()
        stdout.close()
        for pid in [proc.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _int_flags() -> list[tuple[list[str], str, bool]]:
    """Every integer flag of every command: (command words, flag, whether 0 is allowed)."""
    import argparse

    from sart.cli import _parser
    from sart.flags import MAY_BE_ZERO

    found: list[tuple[list[str], str, bool]] = []

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*words, name])
            elif action.type is int and action.option_strings:
                found.append((words, action.option_strings[0], action.dest in MAY_BE_ZERO))

    walk(_parser(), [])
    return found


def _is_list(words: list[str], flag: str) -> bool:
    import argparse

    from sart.cli import _parser

    parser: argparse.ArgumentParser = _parser()
    for word in words:
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subs.choices[word]
    action = next(a for a in parser._actions if flag in a.option_strings)
    return action.nargs in ("+", "*")


#: What each command needs besides the flag under test, to parse.
REQUIRED = {
    ("eval",): ["--dataset", "testbed", "--model", "testbed"],
    ("trace", "record"): ["out.jsonl"],
    ("demo-models",): ["out"],
}


@pytest.mark.parametrize(
    ("words", "flag", "zero_ok"),
    _int_flags(),
    ids=[" ".join([*w, f]) for w, f, _ in _int_flags()],
)
def test_every_commands_integer_flags_refuse_counts_below_their_floor(
    words: list[str], flag: str, zero_ok: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused before the command runs: none of these starts a server or loads a model.
    for value in ("-1",) if zero_ok else ("-1", "0"):
        with pytest.raises(SystemExit) as info:
            main([*words, *REQUIRED.get(tuple(words), []), flag, value])
        assert info.value.code == 2
        floor = 0 if zero_ok else 1
        shown = f"[{value}]" if _is_list(words, flag) else value
        assert f"sart: error: {flag} {shown} must be >= {floor}" in capsys.readouterr().err


def test_the_walk_finds_every_commands_counts() -> None:
    flags = {(" ".join(w), f) for w, f, _ in _int_flags()}
    assert {("bench", "--requests"), ("serve", "--max-queue"), ("tune", "--jobs")} <= flags
    assert {("trace record", "--n"), ("quickstart", "--requests"), ("eval", "--limit")} <= flags
    assert len(flags) > 40


def test_demo_models_hint_joins_paths_given_with_a_slash(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # Before: `sart demo-models demo/` printed `--model demo//policy`.
    import sart.demo_models

    monkeypatch.setattr(sart.demo_models, "build_demo_models", lambda *a, **k: {})
    assert main(["demo-models", f"{tmp_path}/"]) == 0
    hint = capsys.readouterr().out
    assert f"--model {tmp_path}/policy --prm {tmp_path}/qwen-prm" in hint
    assert "//" not in hint


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["serve", "--engine", "vllm", "--tensor-parallel-size", "2"],
            "unrecognized arguments: --tensor-parallel-size 2; vLLM's engine arguments go "
            "through --vllm-arg KEY=VALUE",
        ),
        (
            ["bench", "--engine", "sglang", "--model", "m", "--tp-size", "2"],
            "unrecognized arguments: --tp-size 2; SGLang's server arguments go through "
            "--sglang-arg KEY=VALUE",
        ),
        (["bench", "--foo", "1"], "unrecognized arguments: --foo 1\n"),  # no engine's: no hint
    ],
)
def test_an_engines_own_flag_says_where_it_goes(
    argv: list[str], said: str, capsys: pytest.CaptureFixture
) -> None:
    # Before: only "unrecognized arguments", to a vLLM user typing vLLM's flags.
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"sart: error: {said}" in capsys.readouterr().err
