"""Test configuration: Hypothesis profiles, the ``--slow`` switch, shared engines.

``pytest`` runs the "default" profile (no deadline, failure blobs printed);
``pytest --slow`` runs the "slow" profile (10x the examples) and also the
tests marked ``@pytest.mark.slow``, which are skipped otherwise.

The session fixtures build what costs seconds once for the whole run: the
demo models (``sart.demo_models``), one vLLM engine, one ``AsyncLLM`` and one
``vllm serve`` over the demo policy (and a second one for tests of a fleet),
and one real ``sglang.Engine`` and one ``sglang.launch_server`` on SGLang's CPU
path (``sglang_cpu``). Tests wrap fresh adapters around the engines
(``adapters.fresh_vllm``, ``adapters.fresh_vllm_async``, ``SGLangEngine(engine)``)
and leave them with no request. The vLLM ones are skipped where vLLM is not
installed, the SGLang ones where SGLang is not (``scripts/sglang_cpu_env.sh``
builds a venv with it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from adapters import (
    VLLM_ENGINE_ARGS,
    VLLM_ENGINES_BUILT,
    VLLM_ENV,
    vllm_serve,
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
        engine = VLLMEngine.from_engine_args(str(demo_models["policy"]), **VLLM_ENGINE_ARGS)
    VLLM_ENGINES_BUILT.append(engine)
    return engine


@pytest.fixture(scope="session")
def vllm_async_bridge(demo_models: dict[str, Path]) -> Iterator[Any]:
    """A ``SyncBridge`` whose engine is a ``VLLMAsyncEngine`` built on the bridge's loop
    (``AsyncLLM`` starts its output handler on the loop running when it is built)."""
    pytest.importorskip("vllm")
    from sart.engines.sync_bridge import SyncBridge
    from sart.engines.vllm_async import VLLMAsyncEngine

    with _vllm_env():
        bridge = SyncBridge.build(
            lambda: VLLMAsyncEngine.from_engine_args(str(demo_models["policy"]), **VLLM_ENGINE_ARGS)
        )
    VLLM_ENGINES_BUILT.append(bridge.engine)
    yield bridge
    bridge.close()  # shuts vLLM down and drains the loop (else exit hangs in ZeroMQ)


@pytest.fixture(scope="session")
def vllm_server(
    tmp_path_factory: pytest.TempPathFactory, demo_models: dict[str, Path]
) -> Iterator[str]:
    """The URL of a ``vllm serve`` of the demo policy, served as model ``demo``, with
    vLLM's explicit abort endpoint (``--enable-scale-out``)."""
    with serve_vllm(tmp_path_factory, demo_models["policy"], "--enable-scale-out") as url:
        yield url


@pytest.fixture(scope="session")
def vllm_server_pair(
    tmp_path_factory: pytest.TempPathFactory, demo_models: dict[str, Path], vllm_server: str
) -> Iterator[tuple[str, str]]:
    """Two ``vllm serve`` of the demo policy (the session's one and one more), for a
    gateway in front of a fleet."""
    with serve_vllm(tmp_path_factory, demo_models["policy"], "--enable-scale-out") as url:
        yield vllm_server, url


@contextlib.contextmanager
def serve_vllm(tmp_path_factory: pytest.TempPathFactory, model: Path, *flags: str) -> Iterator[str]:
    """``adapters.vllm_serve`` with its log in a temporary directory of the session."""
    pytest.importorskip("vllm")
    pytest.importorskip("httpx")
    log = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
    with vllm_serve(model, log, *flags) as url:
        yield url


# ------------------------------------------------------------------ SGLang on the CPU


@pytest.fixture(scope="session")
def sglang_cpu() -> Iterator[None]:
    """SGLang's CPU environment (``sglang_cpu.cpu_environment``: the shims on the import
    path, ``SGLANG_USE_CPU_ENGINE=1``) for the rest of the session; skipped without
    sglang (failed with ``SART_REQUIRE_SGLANG=1``, as CI sets). SGLang must not have
    been imported before."""
    if importlib.util.find_spec("sglang") is None:
        reason = "real SGLang: not installed (scripts/sglang_cpu_env.sh builds a venv)"
        if os.environ.get("SART_REQUIRE_SGLANG"):  # CI's SGLang run must not skip them
            pytest.fail(reason)
        pytest.skip(reason)
    from sglang_cpu import cpu_environment

    with cpu_environment():
        yield


@pytest.fixture(scope="session")
def sglang_engine(sglang_cpu: None, demo_models: dict[str, Path]) -> Iterator[Any]:
    """A real ``sglang.Engine`` over the demo policy on SGLang's CPU path
    (``sglang_cpu.SGLANG_CPU_ARGS``), its scheduler and detokenizer in child processes."""
    import sglang

    from sglang_cpu import SGLANG_CPU_ARGS

    engine = sglang.Engine(model_path=str(demo_models["policy"]), **SGLANG_CPU_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def sglang_server(
    sglang_cpu: None, tmp_path_factory: pytest.TempPathFactory, demo_models: dict[str, Path]
) -> Iterator[str]:
    """The URL of a ``python -m sglang.launch_server`` of the demo policy on SGLang's CPU
    path, served as model ``demo``."""
    pytest.importorskip("httpx")
    from sglang_cpu import sglang_launch_server

    log = tmp_path_factory.mktemp("sglang-serve") / "sglang-serve.log"
    with sglang_launch_server(demo_models["policy"], log) as url:
        yield url
