"""vLLM's own load generator, ``vllm bench serve``, against ``sart serve`` on loopback:
128 random prompts at 64 in flight, every one answered (0 failed), against
``sart serve --model testbed`` (transformers) and through the gateway
(``--engine openai``) in front of the session's ``vllm serve`` of the demo
policy. The client sends vLLM's own sampling fields with every request
(``repetition_penalty``, ``logprobs: null``), which sart serve takes.

Runs where vLLM is installed (CI's vLLM stage), through
``scripts/vllm_bench_serve.py``: the ``vllm`` command itself does not start
on the CPU wheel (it reads the version of a distribution named ``vllm``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("fastapi")

from serving import KEY, Server

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, CONCURRENCY = 128, 64


def vllm_bench_serve(url: str, model: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    """``vllm bench serve`` of ``PROMPTS`` random prompts at ``CONCURRENCY``; its result."""
    command = [
        sys.executable, str(ROOT / "scripts" / "vllm_bench_serve.py"),
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "12",
        "--num-prompts", str(PROMPTS), "--max-concurrency", str(CONCURRENCY), "--seed", "0",
        "--save-result", "--result-dir", str(out), "--result-filename", "result.json",
        "--disable-tqdm", "--save-detailed",  # detailed: with each request's error
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def check(result: dict[str, Any], server: Server) -> None:
    errors = sorted({e for e in result["errors"] if e})
    code, log = server.stop()
    # vllm bench reads no error event (it reports a failed stream as "never received a
    # valid chunk"): the reason sart serve gave is in its log.
    failures = [line for line in log.splitlines() if "(HTTP " in line][:5]
    assert (result["completed"], result["failed"]) == (PROMPTS, 0), (errors, failures)
    assert code == 0 and "Traceback" not in log, log


def test_vllm_bench_serve_gets_every_answer_from_sart_serve(tmp_path: Path) -> None:
    from sart.launch import resolve_models

    policy = Path(resolve_models("testbed", None, "qwen")[0])
    server = Server("--model", "testbed", "--api-key", KEY, "--max-queue", "256")
    check(vllm_bench_serve(server.url, "testbed", policy, tmp_path), server)


def test_vllm_bench_serve_gets_every_answer_through_the_gateway(
    vllm_server: str, demo_models: dict[str, Path], tmp_path: Path
) -> None:
    policy = demo_models["policy"]
    server = Server(
        "--engine", "openai", "--upstream", vllm_server, "--model", "demo",
        "--prm", "testbed", "--tokenizer", str(policy), "--api-key", KEY,
        "--method", "sc", "--n", "2", "--max-tokens", "16", "--max-tokens-limit", "4000",
        "--batch-size", "32",
    )  # fmt: skip
    check(vllm_bench_serve(server.url, "demo", policy, tmp_path), server)
