"""``scripts/cost_model_check.py`` runs end to end on a CPU with a tiny model.

The check itself needs a GPU (it times a random-weight model of the preset's
shape); this keeps the script from rotting. Skipped without torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cost_model_check.py"


@pytest.mark.parametrize("through", ["engine", "graphs", "static"])
def test_it_times_every_combination_and_writes_the_rows(tmp_path: Path, through: str) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--batch", "1", "3",
         "--context", "8", "32", "--steps", "2", "--warmup", "1", "--out", str(out),
         "--through", through],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 8), (3, 8), (1, 32), (3, 32)]
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in rows)
    assert "measured ms" in done.stdout
