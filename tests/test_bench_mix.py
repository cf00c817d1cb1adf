"""Mixed workloads (``sart bench --mix``): classes, FCFS against priorities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sart
from sart.bench.mix import MixClass, classes_of, parse_mix, run_mix
from sart.bench.runner import BenchConfig, traces

SPEC = "interactive:0.2:sart:2,bulk:0.8:sc:8"


def test_a_mix_is_parsed_most_urgent_first() -> None:
    assert parse_mix(SPEC) == (
        MixClass("interactive", 0.2, "sart", 2),
        MixClass("bulk", 0.8, "sc", 8),
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a:0.5:sart", "must be NAME:SHARE:METHOD:N"),
        ("a:x:sart:2", "SHARE must be a number, N an int"),
        ("a:0.5:best:2", "method 'best' must be one of"),
        ("a:0:sart:2", "SHARE must be > 0 and N >= 1"),
        ("a:1:sart:2,a:1:sc:4", "class names must differ"),
    ],
)
def test_a_bad_mix_is_refused(spec: str, message: str) -> None:
    with pytest.raises(sart.ConfigError, match=message):
        parse_mix(spec)


def test_priorities_cut_the_urgent_class_latency_at_little_cost_to_bulk() -> None:
    config = BenchConfig(methods=("sc",), ns=(8,), rates=(4.0,), num_requests=120)
    ((rate, trace),) = traces(config)
    classes = parse_mix(SPEC)
    of = classes_of([r.id for r in trace], classes, config.seed)
    assert of == classes_of(
        [r.id for r in trace], classes, config.seed
    )  # the same classes every time
    assert 0 < sum(1 for k in of.values() if k == 0) < len(trace)
    fcfs = run_mix(trace, classes, config, rate, priorities=False)
    urgent = run_mix(trace, classes, config, rate, priorities=True)
    assert [s.requests for s in fcfs.classes] == [s.requests for s in urgent.classes]
    assert all(r.ok for r in urgent.record.results)
    assert urgent.classes[0].e2e.p97 * 3 < fcfs.classes[0].e2e.p97
    assert urgent.classes[1].e2e.p97 < 1.2 * fcfs.classes[1].e2e.p97


def test_sart_bench_mix_writes_its_comparison(tmp_path: Path) -> None:
    from sart.cli import main

    out = tmp_path / "mix"
    assert main(["bench", "--mix", SPEC, "--requests", "40", "--rate", "2", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    (rate,) = data["rates"]
    assert [run["scheduling"] for run in rate["runs"]] == ["fcfs", "priority"]
    assert [c["name"] for c in rate["runs"][1]["classes"]] == ["interactive", "bulk"]


def test_sart_bench_mix_json_prints_the_document_as_the_other_runs_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the rich tables on stdout, and mix.json where every other run writes
    # results.json.
    from sart.cli import main

    argv = ["bench", "--mix", SPEC, "--requests", "20", "--rate", "2", "--json"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr()
    document = json.loads(printed.out)
    assert document == json.loads((tmp_path / "results.json").read_text())
    assert document["complete"] and document["mix"] == SPEC
    assert "Mixed workload at 2 req/s" in printed.err


def test_mix_replaces_methods_and_n(capsys: pytest.CaptureFixture[str]) -> None:
    from sart.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--mix", SPEC, "--n", "4"])
    assert "--mix names each class's method and N" in capsys.readouterr().err
