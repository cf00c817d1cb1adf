"""The log of a benchmark's runs (``runs.jsonl``) and ``sart bench --resume``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

from sart.bench.run_log import RunLog, resumable_runs
from sart.bench.runner import BenchConfig, run_bench
from sart.cli import main
from sart.digests import sha256
from sart.errors import ConfigError

BENCH = ["bench", "--requests", "12", "--rate", "2", "--n", "2", "--no-plots"]


def test_a_logged_run_reads_back_whole(tmp_path: Path) -> None:
    # SART at two rates: pruned branches, reward histories, per-request KV use, a timeline.
    records = run_bench(BenchConfig(methods=("sart",), ns=(4,), rates=(1.0, 4.0), num_requests=10))
    assert any(b.reward_history for r in records[0].results for b in r.branches)
    log = RunLog(tmp_path)
    log.start(records[:1])
    log.append(records[1])
    assert log.read() == records
    log.start()  # afresh
    assert log.read() == []


def test_a_logged_branchs_stop_reason_reads_back(tmp_path: Path) -> None:
    # A stop string and a stop token id (vLLM's stop_reason), a union cattrs needs a hook for.
    (record,) = run_bench(BenchConfig(methods=("sc",), ns=(2,), rates=(1.0,), num_requests=2))
    first, second = record.results[:2]
    first = attrs.evolve(first, branches=(attrs.evolve(first.branches[0], stop_reason="\n\n"),))
    second = attrs.evolve(second, branches=(attrs.evolve(second.branches[0], stop_reason=7),))
    record = attrs.evolve(record, results=type(record.results)([first, second]))
    log = RunLog(tmp_path)
    log.start([record])
    assert log.read() == [record]


def test_a_line_cut_short_is_left_out_and_another_schema_refused(tmp_path: Path) -> None:
    (record,) = run_bench(BenchConfig(methods=("sc",), ns=(2,), rates=(2.0,), num_requests=6))
    log = RunLog(tmp_path)
    log.start([record, record])
    text = log.path.read_text()
    log.path.write_text(text[: len(text) - 40])  # the machine stopped mid-line
    assert log.read() == [record]
    log.path.write_text('{"schema": "something else"}\n')
    refusal = re.escape("runs.jsonl:1: not a line of sart.bench.runs/1")
    with pytest.raises(ConfigError, match=refusal):
        log.read()


def document(out: Path) -> dict[str, Any]:
    return json.loads((out / "results.json").read_text())


def test_resume_keeps_the_finished_runs_and_serves_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = ["--out", str(tmp_path)]
    assert main([*BENCH, "--methods", "sc", "sart", *out]) == 0
    before = document(tmp_path)
    capsys.readouterr()
    from sart.bench import command

    real_run, served = command.run_method, []
    monkeypatch.setattr(command, "run_method", lambda *a: served.append(a[1:3]) or real_run(*a))
    # Vanilla added in front: it is the only run served; the report lists it first.
    assert main([*BENCH, "--methods", "vanilla", "sc", "sart", "--resume", *out]) == 0
    assert served == [("vanilla", 1)]
    after = document(tmp_path)
    listed = [(r["method"], r["n"]) for r in after["runs"]]
    assert listed == [("vanilla", 1), ("sc", 2), ("sart", 2)]
    assert after["runs"][1:] == before["runs"]  # kept as they were measured
    assert after["resumed"] == [
        {"rate": 2.0, "method": "sc", "n": 2},
        {"rate": 2.0, "method": "sart", "n": 2},
    ]
    assert after["complete"] is True and before["resumed"] == []
    assert "ran 1 run in" in capsys.readouterr().out
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 3
    # Everything done: resuming again serves nothing and reports the same runs.
    served.clear()
    assert main([*BENCH, "--methods", "vanilla", "sc", "sart", "--resume", *out]) == 0
    assert served == [] and document(tmp_path)["runs"] == after["runs"]
    # Without --resume, the benchmark starts afresh.
    assert main([*BENCH, "--methods", "sart", *out]) == 0
    assert len(served) == 1 and document(tmp_path)["resumed"] == []


def test_resume_naming_fewer_runs_keeps_the_others_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = ["--out", str(tmp_path), "--methods", "sc", "sart"]
    bench = ["bench", "--requests", "12", "--n", "2", "--no-plots"]
    assert main([*bench, "--rate", "2", "4", *out]) == 0
    everything = RunLog(tmp_path).read()
    assert len(everything) == 4
    from sart.bench import command

    real_run, served = command.run_method, []
    monkeypatch.setattr(command, "run_method", lambda *a: served.append(a[1:3]) or real_run(*a))
    # One rate named, and a new one: the report shows those; the log keeps the rate-2 runs.
    assert main([*bench, "--rate", "4", "8", "--resume", *out]) == 0
    assert served == [("sc", 2), ("sart", 2)]  # at rate 8 only
    assert {r["rate"] for r in document(tmp_path)["runs"]} == {4.0, 8.0}
    logged = RunLog(tmp_path).read()
    assert len(logged) == 6 and [r for r in logged if r.rate == 2.0] == everything[:2]
    # So naming every rate again serves nothing and reports all six.
    served.clear()
    assert main([*bench, "--rate", "2", "4", "8", "--resume", *out]) == 0
    assert served == [] and len(document(tmp_path)["runs"]) == 6


def test_resume_refuses_another_benchmarks_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*BENCH, "--methods", "sc", "--out", str(tmp_path)]) == 0
    with pytest.raises(SystemExit) as exit_info:
        main([*BENCH, "--methods", "sc", "--interval", "200", "--resume", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--interval (config.interval): 400 then, 200 now" in err
    assert len(document(tmp_path)["runs"]) == 1  # nothing overwritten


def test_resumable_runs_compare_serving_too(tmp_path: Path) -> None:
    assert main([*BENCH, "--methods", "sc", "--out", str(tmp_path)]) == 0
    config = document(tmp_path)["config"]
    assert len(resumable_runs(tmp_path, config, None)) == 1
    assert resumable_runs(tmp_path / "empty", config, None) == []  # nothing to resume
    with pytest.raises(ConfigError, match=re.escape("--model (serving.model): None then, 'm' now")):
        resumable_runs(tmp_path, config, {"model": "m"})


def test_resume_is_refused_with_a_mix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--mix", "a:0.5:sart:2,b:0.5:sc:2", "--resume", "--out", str(tmp_path)])
    assert "a --mix benchmark starts afresh" in capsys.readouterr().err


def test_resume_refuses_a_log_without_its_results_json(tmp_path: Path) -> None:
    # A kept runs.jsonl restored alone (results.json not beside it) was silently started
    # afresh, losing every run it held; now it is refused and the log left whole.
    assert main([*BENCH, "--methods", "sc", "--out", str(tmp_path)]) == 0
    config = document(tmp_path)["config"]
    (tmp_path / "results.json").unlink()
    before = (tmp_path / "runs.jsonl").read_text()
    with pytest.raises(ConfigError, match=re.escape("holds runs.jsonl but no results.json")):
        resumable_runs(tmp_path, config, None)
    assert (tmp_path / "runs.jsonl").read_text() == before


@pytest.mark.parametrize(
    ("damage", "said"),
    [('{"config": {', "not JSON: Expecting"), ("[]", "a JSON list"), ("", "not JSON")],
)
def test_resume_refuses_a_damaged_results_json_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, said: str
) -> None:
    # A results.json cut short, emptied or not an object ended --resume in a traceback
    # (JSONDecodeError, AttributeError); now it is one line, and the log is left whole.
    assert main([*BENCH, "--methods", "sc", "--out", str(tmp_path)]) == 0
    (tmp_path / "results.json").write_text(damage)
    before = (tmp_path / "runs.jsonl").read_text()
    with pytest.raises(SystemExit) as exit_info:
        main([*BENCH, "--methods", "sc", "--resume", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("sart: error: --resume: ") and err.count("\n") == 1
    assert "is not a sart bench results.json (" + said in err
    assert (tmp_path / "runs.jsonl").read_text() == before


def test_a_logged_run_sart_cannot_read_back_is_refused_with_its_line(tmp_path: Path) -> None:
    # A run written by a sart whose RunRecord differed (or edited by hand) ended --resume
    # in cattrs' nested exception groups; now it is a ConfigError naming file:line and field.
    (record,) = run_bench(BenchConfig(methods=("sc",), ns=(2,), rates=(2.0,), num_requests=6))
    log = RunLog(tmp_path)
    log.start([record, record])
    first, second = log.path.read_text().splitlines()
    line = json.loads(second)
    del line["run"]["method"]
    log.path.write_text(first + "\n" + json.dumps(line) + "\n")
    said = "runs.jsonl:2: not a run sart bench can read back (KeyError: 'method' "
    with pytest.raises(ConfigError, match=re.escape(said) + ".*attribute method"):
        log.read()


def test_bench_and_eval_refuse_an_out_holding_the_others_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # sart eval given a benchmark's --out replaced its results.json (and --resume then kept
    # none of its runs), and sart bench an evaluation's; now each refuses, before any work.
    from sart.eval.command import _Run

    bench = tmp_path / "bench"
    assert main([*BENCH, "--methods", "sc", "--out", str(bench)]) == 0
    before = (bench / "results.json").read_text()
    monkeypatch.setattr(_Run, "load", lambda self: pytest.fail("loaded the models"))
    evaluation = ["eval", "--dataset", "testbed", "--model", "testbed", "--limit", "2"]
    with pytest.raises(SystemExit) as exit_info:
        main([*evaluation, "--no-plots", "--out", str(bench)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    said = "holds the results.json of sart bench (sart.bench/1), which this sart eval would"
    assert said in err and err.count("\n") == 1
    assert (bench / "results.json").read_text() == before
    assert not (bench / "problems.jsonl").exists()

    evaluated = tmp_path / "eval"
    evaluated.mkdir()
    (evaluated / "results.json").write_text('{"schema": "sart.eval/1", "runs": []}')
    mix = ["bench", "--mix", "a:0.5:sart:2,b:0.5:sc:2", "--requests", "4", "--rate", "2"]
    for argv in ([*BENCH], [*BENCH, "--resume"], mix):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--out", str(evaluated)])
        assert exit_info.value.code == 2
        assert "holds the results.json of sart eval (sart.eval/1)" in capsys.readouterr().err
    assert (evaluated / "results.json").read_text() == '{"schema": "sart.eval/1", "runs": []}'


def test_an_interrupted_benchmark_is_not_started_afresh_without_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ctrl-C says "the same command with --resume serves only the rest"; the same command
    # without it (a script run again) emptied runs.jsonl of every finished run. Now it,
    # and a --mix into that --out, are refused and the log is left whole.
    from sart.bench import command

    real_run = command.run_method

    def interrupted_on_the_second(*args: Any) -> Any:
        if (tmp_path / "runs.jsonl").read_text():
            raise KeyboardInterrupt
        return real_run(*args)

    monkeypatch.setattr(command, "run_method", interrupted_on_the_second)
    out = ["--out", str(tmp_path)]
    assert main([*BENCH, "--methods", "sc", "sart", *out]) == 130
    log = (tmp_path / "runs.jsonl").read_text()
    monkeypatch.setattr(command, "run_method", real_run)
    mix = ["bench", "--mix", "a:0.5:sart:2,b:0.5:sc:2", "--requests", "4", "--rate", "2"]
    for argv in ([*BENCH, "--methods", "sc", "sart"], mix):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, *out])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "holds an interrupted benchmark (1 finished runs in runs.jsonl): add --resume" in err
        assert (tmp_path / "runs.jsonl").read_text() == log
    # Removing the log (as the refusal says) starts afresh; so does a finished benchmark.
    (tmp_path / "runs.jsonl").unlink()
    assert main([*BENCH, "--methods", "sc", "sart", *out]) == 0
    assert main([*BENCH, "--methods", "sc", *out]) == 0


@pytest.mark.parametrize("flag", ["--trace", "--workload"])
def test_resume_refuses_a_trace_file_changed_under_the_same_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    # results.json held the trace's path only: a trace recorded again under that name was
    # resumed as the same benchmark, mixing runs of other requests in one report.
    trace = tmp_path / "t.jsonl"
    record = ["trace", "record", str(trace), "--requests", "6", "--n", "4", "--interval", "50"]
    assert main([*record, "--seed", "1"]) == 0
    out = tmp_path / "out"
    bench = ["bench", "--n", "2", "--no-plots", flag, str(trace), "--out", str(out)]
    if flag == "--workload":
        bench += ["--requests", "6", "--rate", "2"]
    assert main([*bench, "--methods", "sc"]) == 0
    inputs = document(out)["inputs"]
    assert inputs == {flag: {"path": str(trace), "sha256": sha256(trace)}}
    # The same file: resumed, the kept run not served again.
    assert main([*bench, "--methods", "sc", "vanilla", "--resume"]) == 0
    rate = document(out)["runs"][0]["rate"]
    assert document(out)["resumed"] == [{"rate": rate, "method": "sc", "n": 2}]
    capsys.readouterr()
    assert main([*record, "--seed", "2"]) == 0  # recorded again, same name
    before = (out / "runs.jsonl").read_text()
    with pytest.raises(SystemExit) as exit_info:
        main([*bench, "--methods", "sc", "vanilla", "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {trace}: the file changed since (sha256 " in err
    assert (out / "runs.jsonl").read_text() == before  # nothing lost


def test_resume_keeps_the_runs_of_a_report_written_before_inputs_were_recorded(
    tmp_path: Path,
) -> None:
    assert main([*BENCH, "--methods", "sc", "--out", str(tmp_path)]) == 0
    report = document(tmp_path)
    assert report["inputs"] == {}  # a workload preset reads no file
    del report["inputs"]
    (tmp_path / "results.json").write_text(json.dumps(report))
    assert len(resumable_runs(tmp_path, report["config"], None, {"--trace": {}})) == 1
