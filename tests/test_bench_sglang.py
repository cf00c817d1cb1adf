"""``sart bench --engine sglang --model testbed``: the testbed served by a real SGLang.

Runs the command in a child process in SGLang's CPU environment (``sglang_cpu``:
the shims on the import path, SGLang's CPU flags as ``--sglang-arg``); skipped
where SGLang is not installed (failed with ``SART_REQUIRE_SGLANG=1``, as CI's
SGLang run sets). Without SGLang, the flags are still checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cpu import SGLANG_CPU_ARGS


def sglang_args() -> list[str]:
    keep = ("device", "attention_backend", "sampling_backend", "cuda_graph_backend_decode",
            "cuda_graph_backend_prefill", "grammar_backend", "dtype", "mem_fraction_static",
            "max_total_tokens")  # fmt: skip
    return [f for k in keep for f in ("--sglang-arg", f"{k}={SGLANG_CPU_ARGS[k]}")]


def test_the_testbed_on_sglang_with_every_kind_of_method(sglang_cpu: None, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "sart.cli", "bench", "--engine", "sglang", "--model", "testbed",
         "--requests", "6", "--n", "2", "--rate", "8", "--methods", "vanilla", "sc", "sart",
         "--no-plots", "--out", str(out), *sglang_args()],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["complete"] and data["config"]["engine"] == "sglang"
    runs = {(r["method"], r["n"]): r for r in data["runs"]}
    assert set(runs) == {("vanilla", 1), ("sc", 2), ("sart", 2)}
    for run in runs.values():
        assert run["summary"]["failed"] == 0 and run["summary"]["accuracy"] is not None
    assert "SGLang model testbed" in done.stdout


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        # Two tensor-parallel ranks on this one-NUMA-node CPU: SGLang's scheduler child
        # fails its start and SIGQUITs sart, whose process SGLang's own handler would kill
        # (the shell said "Killed", exit 137).
        ("tp_size=2", "SGLang's engine did not start: a child process failed"),
        ("atention_backend=torch_native", "has no field 'atention_backend' (did you mean"),
    ],
)
def test_a_start_sglang_refuses_is_one_line_and_sart_exits_on_its_own(
    sglang_cpu: None, tmp_path: Path, flag: str, said: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sart.cli", "bench", "--engine", "sglang", "--model", "testbed",
         "--requests", "1", "--n", "2", "--rate", "8", "--methods", "sc", "--no-plots",
         "--out", str(tmp_path / "bench"), *sglang_args(), "--sglang-arg", flag],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert said in last and "--sglang-arg" in last, done.stderr[-3000:]


def test_the_long_testbed_on_sglang(sglang_cpu: None, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "sart.cli", "bench", "--engine", "sglang", "--model",
         "testbed-long", "--requests", "4", "--n", "2", "--rate", "20", "--methods", "sc",
         "sart", "--no-plots", "--out", str(out), *sglang_args()],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["complete"] and data["config"]["interval"] == 64
    for run in data["runs"]:
        assert run["summary"]["failed"] == 0 and run["summary"]["accuracy"] is not None
        tokens = [b["tokens"] for r in run["requests"] for b in r["branches"]]
        assert max(tokens) <= 2048 and sum(tokens) / len(tokens) > 100


def test_sglang_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from sart.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--engine", "hf", "--model", "testbed", "--sglang-arg", "tp_size=2"])
    assert "--sglang-arg has no effect with --engine hf (it is for --engine sglang)" in (
        capsys.readouterr().err
    )
