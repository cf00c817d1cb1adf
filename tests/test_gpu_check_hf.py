"""``scripts/gpu_check.py --engine hf`` runs end to end on the CPU in its quick mode,
inside ``scripts/gpu_session.sh --quick`` (every GPU measurement the transformers
engine owes, as one command: the checks, ``benchmarks/hf_decode.py`` and
``scripts/cost_model_check.py`` through the engine and over CUDA graphs).

The GPU run itself needs a GPU machine; this keeps the scripts from rotting (and
needs no vLLM: the transformers mode is torch and transformers only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SESSION = ROOT / "scripts" / "gpu_session.sh"
CHECKS = (
    "environment",
    "conformance",
    "greedy parity",
    "graph parity",
    "step cost",
    "graph steps",
    "prm cost",
    "7b decode",
    "7b graphs",
    "7b prm",
    "bench",
)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder ``gpu_session.sh --quick`` wrote (it exited 0)."""
    out = tmp_path_factory.mktemp("gpu-session")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SESSION), str(out), "--quick"],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_every_check_passes_and_lands_in_the_json(session: Path) -> None:
    log = (session / "gpu-check.log").read_text()
    lines = [line for line in log.splitlines() if line[:4] in ("PASS", "FAIL")]
    assert [line[6:20].strip() for line in lines] == list(CHECKS)
    rows = json.loads((session / "gpu-check.json").read_text())
    assert [row["check"] for row in rows] == list(CHECKS) and all(row["ok"] for row in rows)
    assert rows[3]["data"]["tokens"] > 0  # graph parity (on a CPU: not captured)
    for steps in (rows[4]["data"], rows[5]["data"]):  # without and with graphs
        assert set(steps) == {"8", "32"}
        assert all(v["launches_per_step"] > 0 for v in steps.values())
    assert set(rows[6]["data"]) == {"8", "32"}
    assert {"1", "8"} <= set(rows[8]["data"])  # 7b graphs
    assert set(rows[10]["data"]) == {"vanilla", "sc", "sart"}


def test_the_session_runs_every_step_and_keeps_its_output(session: Path) -> None:
    steps = ["gpu-check", "hf-decode", "cost-engine", "cost-graphs"]
    assert (session / "summary.txt").read_text().splitlines() == [f"{s} rc=0" for s in steps]
    assert "same tokens: yes" in (session / "hf-decode.log").read_text()
    for through in ("engine", "graphs"):
        rows = json.loads((session / f"cost-{through}.json").read_text())["rows"]
        assert [(r["batch"], r["context"]) for r in rows] == [(1, 64), (4, 64)]
        assert all(r["measured_s"] > 0 and r["steps_without_graphs"] == 0 for r in rows)


def test_a_failing_step_fails_the_session(tmp_path: Path) -> None:
    # A python that fails every step: each is noted and the session exits 1.
    env = {**os.environ, "PYTHON": "false"}
    done = subprocess.run(
        ["bash", str(SESSION), str(tmp_path), "--quick"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 1
    assert (tmp_path / "summary.txt").read_text().splitlines() == [
        f"{s} rc=1" for s in ("gpu-check", "hf-decode", "cost-engine", "cost-graphs")
    ]


def test_without_a_gpu_it_fails_unless_told_to_use_the_cpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--engine", "hf"], capture_output=True, text=True
    )
    assert done.returncode == 1 and "torch sees no GPU" in done.stdout


def test_the_json_keeps_every_finished_check_as_it_goes(tmp_path: Path) -> None:
    # A GPU run stopped at its time limit must keep the checks it finished.
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from check_report import Report
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    out = tmp_path / "checks.json"
    report = Report(json_path=out)
    report.check("first", lambda: ("fine", {"x": 1}))
    assert [row["check"] for row in json.loads(out.read_text())] == ["first"]

    def broken() -> str:
        raise RuntimeError("planted")

    report.check("second", broken)
    rows = json.loads(out.read_text())
    assert [(row["check"], row["ok"]) for row in rows] == [("first", True), ("second", False)]
    assert "RuntimeError: planted" in rows[1]["detail"]
    assert report.finish() == 1
