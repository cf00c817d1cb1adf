"""`sart bench` and `sart trace record` end to end, on small configurations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sart.cli import main


def bench(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    argv = ["bench", "--requests", "12", "--n", "2", "4", "--rate", "2", "--out", str(out)]
    assert main([*argv, *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_bench_writes_table_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = bench(tmp_path)
    printed = capsys.readouterr().out
    for label in ("Vanilla", "SC", "Rebase", "SART-noprune", "SART", "SC / SART"):
        assert label in printed
    assert doc["schema"] == "sart.bench/1"
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
        assert all(r["correct"] in (True, False) for r in run["requests"])
    assert [(r["rate"], r["n"]) for r in doc["ratios_p97"]] == [(2.0, 2), (2.0, 4)]
    for name in ("latency_accuracy.png", "resources.png", "distributions.png"):
        assert (tmp_path / "out" / name).stat().st_size > 10_000


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
    lines = trace.read_text().splitlines()
    assert len(lines) == 5
    assert json.loads(lines[0])["interval"] == 50
    first = bench(
        tmp_path, "--trace", str(trace), "--model", "steps", "--interval", "50", "--no-plots"
    )
    again = bench(
        tmp_path, "--trace", str(trace), "--model", "steps", "--interval", "50", "--no-plots"
    )
    assert first["time_unit"] == "decode steps"
    assert [r["rate"] for r in first["runs"]] == [None] * len(first["runs"])
    strip = [{k: v for k, v in r.items()} for r in first["runs"]]
    assert strip == again["runs"]  # a replay is deterministic


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--n", "0"], "ns=(0,) must be non-empty, each >= 1"),
        (["bench", "--requests", "0"], "num_requests=0 must be >= 1"),
        (["bench", "--rate", "-1"], "rates=(-1.0,) must be non-empty, each > 0"),
        (["bench", "--trace", "/nonexistent/trace.jsonl"], "No such file"),
        (["bench", "--model", "tpu"], "cost model 'tpu' must be one of ['8xh100-70b'"),
        (["bench", "--methods", "beam"], "invalid choice: 'beam'"),
    ],
)
def test_bad_flags_are_usage_errors(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path)])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_default_branch_budget_fits_the_kv_cache(tmp_path: Path) -> None:
    from sart.engines.costs import PRESETS

    doc = bench(tmp_path, "--no-plots", "--methods", "sart")
    # h100-14b KV capacity / (gaokao prompt 300 + 1.25 x median length 3500)
    expected = PRESETS["h100-14b"].kv_capacity_tokens // (300 + 1.25 * 3500)
    assert {r["batch_size"] for r in doc["runs"]} == {int(expected)} == {46}
    doc = bench(tmp_path, "--no-plots", "--methods", "sart", "--model", "steps")
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
