"""Test configuration: Hypothesis profiles, the ``--slow`` switch, shared engines.

``pytest`` runs the "default" profile (no deadline, failure blobs printed);
``pytest --slow`` runs the "slow" profile (10x the examples) and also the
tests marked ``@pytest.mark.slow``, which are skipped otherwise.

The session fixtures build what costs seconds once for the whole run: the
demo models (``sart.demo_models``), one vLLM engine, one ``AsyncLLM`` and one
``vllm serve`` over the demo policy. Tests wrap fresh adapters around the vLLM
engines (``adapters.fresh_vllm``, ``adapters.fresh_vllm_async``) and leave
them with no request. The vLLM ones are skipped where vLLM is not installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from adapters import (
    VLLM_ENGINE_ARGS,
    VLLM_ENV,
    VLLM_MAX_NUM_SEQS,
    VLLM_SERVER_MAX_MODEL_LEN,
    free_port,
)

settings.register_profile("default", deadline=None, print_blob=True)
settings.register_profile(
    "slow",
    settings.get_profile("default"),
    max_examples=10 * settings.get_profile("default").max_examples,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="run tests marked slow and use the 'slow' Hypothesis profile (10x examples)",
    )


def pytest_configure(config: pytest.Config) -> None:
    settings.load_profile("slow" if config.getoption("--slow") else "default")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow test: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------ shared engines


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``sart.demo_models.build_demo_models``: the tiny random policy, PRMs and prompts
    (read-only: tests that change a model copy it)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from sart.demo_models import build_demo_models

    return build_demo_models(tmp_path_factory.mktemp("demo"))


@contextlib.contextmanager
def _vllm_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in VLLM_ENV.items():
            mp.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def vllm_engine(demo_models: dict[str, Path]) -> Any:
    """A ``VLLMEngine`` over the demo policy, its engine core in this process."""
    pytest.importorskip("vllm")
    from sart.engines.vllm import VLLMEngine

    with _vllm_env():
        return VLLMEngine.from_engine_args(str(demo_models["policy"]), **VLLM_ENGINE_ARGS)


@pytest.fixture(scope="session")
def vllm_async_bridge(demo_models: dict[str, Path]) -> Iterator[Any]:
    """A ``SyncBridge`` whose engine is a ``VLLMAsyncEngine`` built on the bridge's loop
    (``AsyncLLM`` starts its output handler on the loop running when it is built)."""
    pytest.importorskip("vllm")
    from sart.engines.streaming import SyncBridge
    from sart.engines.vllm_async import VLLMAsyncEngine

    with _vllm_env():
        bridge = SyncBridge.build(
            lambda: VLLMAsyncEngine.from_engine_args(str(demo_models["policy"]), **VLLM_ENGINE_ARGS)
        )
    yield bridge
    bridge.close()  # shuts vLLM down and drains the loop (else exit hangs in ZeroMQ)


VLLM_SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    # One unpinned OpenMP thread: by default vLLM-CPU pins a thread to every core,
    # and on a 2-core machine the test process (the client) then starves; a slow
    # client let aborted branches run to their end before the abort reached vLLM.
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


@pytest.fixture(scope="session")
def vllm_server(
    tmp_path_factory: pytest.TempPathFactory, demo_models: dict[str, Path]
) -> Iterator[str]:
    """The URL of a ``vllm serve`` of the demo policy, served as model ``demo``."""
    pytest.importorskip("vllm")
    httpx = pytest.importorskip("httpx")
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
    log = log_path.open("w")
    cmd = [
        # `vllm serve` reads the version of a distribution named "vllm", which
        # vllm-cpu is not; its deprecated module entry point skips that.
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(demo_models["policy"]),
        "--served-model-name",
        "demo",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        str(VLLM_SERVER_MAX_MODEL_LEN),
        "--max-num-seqs",
        str(VLLM_MAX_NUM_SEQS),
        "--enforce-eager",
        "--seed",
        "0",
    ]
    env = {**os.environ, **VLLM_SERVER_ENV}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited ({proc.returncode}):\n" + log_path.read_text()[-4000:]
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not become healthy in 240 s")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
