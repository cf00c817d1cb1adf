"""``python -m sart.serve.bench`` (``sart/serve/bench.py``) runs, in a quick mode.

The server benchmark lives in the package, not in ``benchmarks/``, so
``tests/test_benchmarks.py`` does not see it. Here it runs in a subprocess with
two clients of one request each, every mode (the driver, the async driver, the
service, and ``sart serve`` over HTTP on 127.0.0.1) and N = 2, and its table
must have a row per method and mode. Nothing is timed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
MODES = ("driver", "async-driver", "service", "http")


def test_the_server_benchmark_runs_every_mode_below_the_servers_default_n() -> None:
    # N = 2, below the server's default n of 8: the benchmark must pass both.
    args = "--clients 2 --requests 1 --methods vanilla sart --n 2 --batch-size 8 --rounds 1"
    command = [sys.executable, "-m", "sart.serve.bench", *args.split(), "--modes", *MODES]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for method in ("vanilla", "sart"):
        for mode in MODES:
            row = rf"^\s*{method}\s+{mode}\s+[\d.]+\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$"
            assert re.search(row, out.stdout, re.MULTILINE), (method, mode, out.stdout[-2000:])
