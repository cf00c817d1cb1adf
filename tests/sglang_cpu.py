"""A real SGLang on this CPU machine, for the tests: its environment, arguments and server.

SGLang (0.5.23, built by ``scripts/sglang_cpu_env.sh``) runs its own CPU path
here: ``SGLANG_USE_CPU_ENGINE=1``, torch-native attention and sampling, no
CUDA graphs, float32. Two packages it imports are stood in for by
``tests/shims`` (``sgl_kernel``: one pure-torch op, the rest importable but
not callable; ``torchvision``: importable, not callable); each says what it
replaces, why SGLang's own code still runs, and what would break it.
``cpu_environment()`` puts the shims first on the import path (``sys.path``
and ``PYTHONPATH``, which SGLang's child processes and ``launch_server``
inherit) and sets the environment; ``conftest.py`` builds one
``sglang.Engine`` and one ``python -m sglang.launch_server`` per session in
it. The fixtures skip where ``sglang`` is not installed (the main venv).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from adapters import free_port, serve_subprocess

SHIMS = Path(__file__).resolve().parent / "shims"
"""The stand-in packages (``sgl_kernel``, ``torchvision``) for SGLang on a CPU."""

SGLANG_CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",  # else SGLang does not take its CPU path
    "OMP_NUM_THREADS": "1",  # the scheduler and the test share 2 cores
}
"""The environment SGLang runs in on this machine (``PYTHONPATH`` gets ``SHIMS``)."""

SGLANG_CONTEXT_LEN = 4096
"""``context_length`` of the session's SGLang engine and server: room for branches
that outlive an abort (the tiny model decodes hundreds of tokens a second, and a
server runs ahead of what its client has read)."""

SGLANG_MAX_RUNNING = 64
"""``max_running_requests`` of the session's SGLang engine and server."""

SGLANG_CPU_ARGS: dict[str, Any] = dict(
    device="cpu",
    attention_backend="torch_native",
    sampling_backend="pytorch",
    cuda_graph_backend_decode="disabled",
    cuda_graph_backend_prefill="disabled",
    grammar_backend="none",
    dtype="float32",  # exact greedy comparisons: no bf16 rounding
    max_total_tokens=32768,  # KV slots; the demo policy's take 256 bytes a token
    mem_fraction_static=0.5,
    context_length=SGLANG_CONTEXT_LEN,
    max_running_requests=SGLANG_MAX_RUNNING,
    random_seed=0,
    log_level="warning",
)
"""``sglang.Engine`` keywords (``--kebab-case`` flags for ``launch_server``) of the
session's SGLang: its CPU path, exact float32, a small KV pool. The radix cache
stays on (it shares a prompt between its branches)."""


NO_EOS = {"ignore_eos": True}
"""SGLang's own sampling parameter the tests add to every request: seeds do not repeat
on SGLang's CPU path (``enable_deterministic_inference`` needs a GPU attention
backend), so a branch of the random demo policy would otherwise sample its EOS at
a random step, and scenarios that need a branch alive at a check would be flaky.
Branches end by ``max_tokens`` and stop strings (SGLang's ``"stop"`` finish, the same
reason an EOS gives)."""


def sglang_adapter(engine: Any, *, greedy: bool = False, **kwargs: Any) -> Any:
    """``SGLangEngine(engine, **kwargs)`` whose requests add ``NO_EOS`` (and, with
    ``greedy``, temperature 0: how ``check_engine``'s two runs compare on SGLang-CPU)."""
    from sart.engines.sglang import SGLangEngine

    adapter = SGLangEngine(engine, **kwargs)
    plain = SGLangEngine.sampling_params

    def params(sampling: Any, seed: int, max_new_tokens: int) -> dict:
        extra = {"temperature": 0.0} if greedy else {}
        return {**plain(sampling, seed, max_new_tokens), **NO_EOS, **extra}

    adapter.sampling_params = params  # type: ignore[method-assign]
    return adapter


def cpu_flags(args: dict[str, Any] = SGLANG_CPU_ARGS) -> list[str]:
    """``SGLANG_CPU_ARGS`` as ``launch_server`` flags."""
    flags: list[str] = []
    for key, value in args.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


@contextlib.contextmanager
def cpu_environment() -> Iterator[None]:
    """``SGLANG_CPU_ENV`` and the shims first on ``sys.path`` and ``PYTHONPATH``, until
    the block ends (SGLang must first be imported inside it)."""
    saved = {name: os.environ.get(name) for name in [*SGLANG_CPU_ENV, "PYTHONPATH"]}
    os.environ.update(SGLANG_CPU_ENV)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIMS), saved["PYTHONPATH"]) if p)
    sys.path.insert(0, str(SHIMS))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(SHIMS))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load(engine: Any) -> tuple[int, int]:
    """SGLang's scheduler's own count of (running, waiting) requests, from the load
    snapshot it publishes (``TokenizerManager.get_loads``; ``/v1/loads`` on a server)."""

    async def get() -> Any:
        return await engine.tokenizer_manager.get_loads()

    (snapshot,) = engine.loop.run_until_complete(get())
    return snapshot.num_running_reqs, snapshot.num_waiting_reqs


def wait_for_load(engine: Any, n: int, timeout: float = 10.0) -> tuple[int, int]:
    """Wait until SGLang's scheduler runs or queues exactly ``n`` requests (its snapshot
    lags a scheduler step); returns the last (running, waiting)."""
    deadline = time.monotonic() + timeout
    while True:
        running, waiting = load(engine)
        if running + waiting == n or time.monotonic() > deadline:
            return running, waiting
        engine.loop.run_until_complete(asyncio.sleep(0.01))


def in_flight(engine: Any, prefix: str = "") -> list[str]:
    """The rids SGLang's tokenizer manager still holds state for (starting with ``prefix``)."""
    return [rid for rid in engine.tokenizer_manager.rid_to_state if rid.startswith(prefix)]


def wait_for_no_flight(engine: Any, timeout: float = 10.0) -> list[str]:
    """Run SGLang's loop until its tokenizer manager holds no request (it drops an
    aborted one when its output loop handles the scheduler's answer, which can come a
    step after the scheduler's load reads 0); the rids still held at the timeout."""
    deadline = time.monotonic() + timeout
    while (held := in_flight(engine)) and time.monotonic() < deadline:
        engine.loop.run_until_complete(asyncio.sleep(0.01))
    return held


def server_load(url: str) -> int:
    """The requests a SGLang server's scheduler runs or queues (its ``GET /v1/loads``)."""
    import httpx

    loads = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=5).json()["loads"]
    return sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in loads)


def wait_for_server_load(url: str, n: int, timeout: float = 10.0) -> int:
    """Wait until a SGLang server's scheduler runs or queues exactly ``n`` requests (its
    snapshot lags a scheduler step); returns the last count."""
    deadline = time.monotonic() + timeout
    while (count := server_load(url)) != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


@contextlib.contextmanager
def sglang_launch_server(model: Path, log_path: Path, *flags: str) -> Iterator[str]:
    """Run ``python -m sglang.launch_server`` of ``model`` (served as ``demo``) on a free
    loopback port with ``SGLANG_CPU_ARGS`` until the block ends, its output in
    ``log_path``; yields its URL once healthy. Call inside ``cpu_environment()``."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--served-model-name",
        "demo",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *cpu_flags(),
        *flags,
    ]
    with serve_subprocess(cmd, dict(os.environ), log_path, port) as url:
        yield url
