"""``scripts/gpu_check.py --engine hf`` runs end to end on the CPU in its quick mode.

The GPU run itself needs a GPU machine; this keeps the script from rotting (and
needs no vLLM: the transformers mode is torch and transformers only).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
CHECKS = (
    "environment",
    "conformance",
    "greedy parity",
    "graph parity",
    "step cost",
    "graph steps",
    "prm cost",
    "bench",
    "7b decode",
    "7b graphs",
    "7b prm",
)


def test_every_check_passes_and_lands_in_the_json(tmp_path: Path) -> None:
    out = tmp_path / "checks.json"
    argv = [sys.executable, str(SCRIPT), "--engine", "hf", "--allow-cpu", "--quick"]
    done = subprocess.run([*argv, "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line[:4] in ("PASS", "FAIL")]
    assert [line[6:20].strip() for line in lines] == list(CHECKS)
    rows = json.loads(out.read_text())
    assert [row["check"] for row in rows] == list(CHECKS) and all(row["ok"] for row in rows)
    assert rows[3]["data"]["tokens"] > 0  # graph parity (on a CPU: not captured)
    for steps in (rows[4]["data"], rows[5]["data"]):  # without and with graphs
        assert set(steps) == {"8", "32"}
        assert all(v["launches_per_step"] > 0 for v in steps.values())
    assert set(rows[6]["data"]) == {"8", "32"}
    assert set(rows[7]["data"]) == {"vanilla", "sc", "sart"}
    assert {"1", "8"} <= set(rows[9]["data"])  # 7b graphs


def test_without_a_gpu_it_fails_unless_told_to_use_the_cpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--engine", "hf"], capture_output=True, text=True
    )
    assert done.returncode == 1 and "torch sees no GPU" in done.stdout
