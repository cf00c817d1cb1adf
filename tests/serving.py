"""``sart serve`` for the tests, on 127.0.0.1: ``Served``, the app in a thread of the
test process (uvicorn, the real app); ``Server``, the command in a child process,
as a user runs it. Both with the clients the tests call them with: the official
``openai`` client and ``httpx``."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn


class Served:
    """A server in a thread, its engine, and clients."""

    def __init__(self, app: Any, engine: Any) -> None:
        self.engine = engine
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)  # a bound on a hang, generous for a loaded machine
        assert not self.thread.is_alive(), "server did not stop"

    def openai(self, key: str | None = "key") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0)

    def post(self, path: str, body: object, timeout: float = 30) -> httpx.Response:
        headers = {"Authorization": "Bearer key"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=timeout)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
        found = re.search(pattern, text, re.M)
        return float(found.group(1)) if found else 0.0

    def wait_for(self, check: Callable[[], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.02)


@contextlib.contextmanager
def scripted_apps(model: str) -> Iterator[Callable[..., Served]]:
    """``start(engine, **settings)``: the real app on ``engine`` in this process, serving
    ``model`` with API key ``key``, a ``ScriptedPRM`` and the other ``ServeConfig``
    ``settings``; every app started is stopped when the block ends."""
    from sart.serve import Backend, ServeConfig, create_app
    from sart.testing import BranchScript, ScriptedPRM

    started: list[Served] = []

    def start(engine: Any, **settings: Any) -> Served:
        config = ServeConfig(models=(model,), api_key="key", **settings)
        prm = ScriptedPRM(lambda branch: BranchScript(rewards=(0.9,)), every=4)
        served = Served(create_app(config, Backend(engine, prm)), engine).__enter__()
        started.append(served)
        return served

    try:
        yield start
    finally:
        for served in started:
            served.__exit__()


KEY = "sk-test-key"


class Server:
    """``sart serve`` in a child process."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, port: int = 0) -> None:
        """``port``: 0 for a free one, which the server's log names; another for a server
        whose log is too quiet to name it (``--log-level warning``), found by ``/health``."""
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sart-serve-", suffix=".log")
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        env.pop("SART_API_KEY", None)
        command = [sys.executable, "-m", "sart.cli", "serve", "--port", str(port), *flags]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            text = Path(self.log.name).read_text()
            found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", text)
            if found:
                self.url = found.group(1)
                break
            if port and _healthy(f"http://127.0.0.1:{port}"):
                self.url = f"http://127.0.0.1:{port}"
                break
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"sart serve did not start:\n{text}")
            time.sleep(0.1)

    def stop(self) -> tuple[int, str]:
        """Stop it as Ctrl-C does; its exit code and its log."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=30), Path(self.log.name).read_text()
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError("sart serve did not stop on SIGINT") from None
        finally:
            self.log.close()

    def client(self, key: str | None = KEY, **options: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **options)

    def metrics(self) -> dict[str, float]:
        """The ``sart:`` samples; a counter not yet counted reads 0."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found = re.findall(r"^(sart:\S+) (\S+)$", text, re.M)
        return collections.defaultdict(float, {name: float(value) for name, value in found})

    def wait_for(self, check: Callable[[dict[str, float]], bool], timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if check(metrics):
                return metrics
            assert time.monotonic() < deadline, f"timed out; metrics: {metrics}"
            time.sleep(0.05)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
