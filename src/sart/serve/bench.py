"""Measure ``sart serve`` on the testbed: throughput and latency under closed-loop load,
and the server's overhead against calling the driver directly.

``python -m sart.serve.bench`` runs the same workload — ``--clients``
concurrent clients, each sending ``--requests`` testbed questions one after
the other (the same questions and seeds in every mode) — three ways, side by
side, alternating modes and methods ``--rounds`` times because a shared
machine is noisy:

- ``driver`` (the baseline): ``sart.SyncDriver`` on the transformers engine
  and the PRM in its own process, in this process, with no server at all:
  when a request finishes its client's next one is submitted at once
  (``on_result``), and latency is the driver's own ``end_to_end``;
- ``service``: the server's ``Service`` in this process, no HTTP: the engine
  on its worker thread, cancellation bookkeeping, metrics;
- ``http``: ``sart serve --model testbed`` in its own process, and clients
  over HTTP on 127.0.0.1 (``httpx``, one connection per client). The
  clients run in this process and take CPU from the same cores, so this
  mode's overhead includes theirs.

``--modes async-driver`` adds ``sart.AsyncDriver`` calling the engine on the
event loop with no thread (what the server does not do: with a synchronous
engine the loop never yields while decoding, so the PRM's overlapped
rewards are seen late).

It prints, per method and mode, requests/s, generated tokens/s and the P50
and P97 of end-to-end latency as the clients see it, the medians over
rounds, and each mode's throughput relative to ``driver``. Needs the
``[hf,serve]`` extras. Run with ``OMP_NUM_THREADS=1`` on small machines.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs

import sart
from sart import testbed
from sart.launch import (
    TESTBED,
    TESTBED_INTERVAL,
    TESTBED_MAX_TOKENS,
    LoadSpec,
    load,
    resolve_models,
)
from sart.metrics import percentile
from sart.serve.config import ServeConfig
from sart.serve.methods import PolicyFields, build_policy

MODES = ("driver", "async-driver", "service", "http")
DEFAULT_MODES = ("driver", "service", "http")


@attrs.frozen
class Run:
    method: str
    mode: str
    wall: float
    latencies: tuple[float, ...]
    tokens: int
    correct: int

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall


def _policy(method: str, n: int) -> sart.Policy:
    fields = PolicyFields(method=method, n=None if method == "vanilla" else n)
    return build_policy(fields, method=method, n=n, max_n=n, interval=TESTBED_INTERVAL)[1]


SETTINGS = sart.SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=TESTBED_MAX_TOKENS)
"""How every mode samples: the in-process ones take it with a seed, HTTP as ``SAMPLING``."""
SAMPLING = {
    "temperature": SETTINGS.temperature,
    "top_p": SETTINGS.top_p,
    "max_tokens": SETTINGS.max_tokens,
}


def _sampling(seed: int) -> sart.SamplingSettings:
    """``SETTINGS`` with ``seed``, for the in-process modes."""
    return attrs.evolve(SETTINGS, seed=seed)


async def _closed_loop(
    clients: int, each: int, ask: Callable[[int, testbed.Question], Awaitable[tuple[str, int]]]
) -> tuple[float, list[float], int, int]:
    """``clients`` tasks, each asking ``each`` questions in turn; wall time, latencies,
    tokens and correct answers."""
    questions = testbed.make_questions(11, clients * each)
    latencies: list[float] = []
    tally = [0, 0]

    async def client(c: int) -> None:
        for k in range(each):
            index = c * each + k
            start = time.perf_counter()
            text, tokens = await ask(index, questions[index])
            latencies.append(time.perf_counter() - start)
            tally[0] += tokens
            tally[1] += testbed.grade(questions[index], text)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return time.perf_counter() - start, latencies, tally[0], tally[1]


def _sync_driver(engine: Any, prm: Any, args: argparse.Namespace) -> Callable[[str], Run]:
    """The baseline: ``SyncDriver`` with the clients' loop closed by ``on_result`` (a
    finished request's client sends its next one at once)."""

    def run(method: str) -> Run:
        policy = _policy(method, args.n)
        questions = testbed.make_questions(11, args.clients * args.requests)
        latencies: list[float] = []
        tally = [0, 0]

        def send(index: int) -> None:
            sampling = _sampling(index)
            request = sart.Request(f"r{index}", questions[index].prompt, policy, sampling)
            driver.submit(attrs.evolve(request, arrival=driver.clock.now()))

        def finished(result: sart.RequestResult) -> None:
            index = int(result.request_id[1:])
            latencies.append(result.timings.end_to_end)
            tally[0] += result.generated_tokens
            tally[1] += testbed.grade(questions[index], result.text or "")
            if index % args.requests + 1 < args.requests:
                send(index + 1)

        driver = sart.SyncDriver(engine, prm, batch_size=args.batch_size, on_result=finished)
        start = time.perf_counter()
        for c in range(args.clients):
            send(c * args.requests)
        driver.run()
        wall = time.perf_counter() - start
        return Run(method, "driver", wall, tuple(latencies), tally[0], tally[1])

    return run


def _in_process(mode: str, engine: Any, prm: Any, args: argparse.Namespace) -> Callable[[str], Run]:
    """``async-driver``: ``AsyncDriver`` calling the engine on the event loop;
    ``service``: the server's ``Service`` (no HTTP)."""

    def run(method: str) -> Run:
        policy = _policy(method, args.n)

        async def main() -> tuple[float, list[float], int, int]:
            if mode == "async-driver":
                driver = sart.AsyncDriver(engine, prm, batch_size=args.batch_size)
                serving = asyncio.create_task(driver.serve())

                async def ask_driver(i: int, q: testbed.Question) -> tuple[str, int]:
                    sampling = _sampling(i)
                    r = await driver.generate(sart.Request(f"r{i}", q.prompt, policy, sampling))
                    return r.text or "", r.generated_tokens

                try:
                    return await _closed_loop(args.clients, args.requests, ask_driver)
                finally:
                    driver.stop()
                    await serving
                    driver.close()
            from sart.serve.service import Service

            config = ServeConfig(
                models=("testbed",), batch_size=args.batch_size, max_n=args.n, n=args.n
            )
            service = Service(engine, prm, config)
            service.start()

            async def ask(i: int, q: testbed.Question) -> tuple[str, int]:
                sampling = _sampling(i)
                rid = service.submit(sart.Request(f"r{i}", q.prompt, policy, sampling))
                outcome = await service.result(rid)
                return outcome.result.text or "", outcome.result.generated_tokens

            try:
                return await _closed_loop(args.clients, args.requests, ask)
            finally:
                await service.stop()

        wall, latencies, tokens, correct = asyncio.run(main())
        return Run(method, mode, wall, tuple(latencies), tokens, correct)

    return run


class _Server:
    """``sart serve --model testbed`` in a child process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sart-serve-bench-", suffix=".log")
        command = [
            *(sys.executable, "-m", "sart.cli", "serve", "--port", "0", "--no-access-log"),
            # --n too: the server's default n (8) must not exceed --max-n.
            *("--batch-size", str(args.batch_size), "--max-n", str(args.n), "--n", str(args.n)),
        ]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            text = Path(self.log.name).read_text()
            found = re.search(r"Uvicorn running on (http://\S+)", text)
            if found:
                self.url = found.group(1)
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("sart serve did not start:\n" + Path(self.log.name).read_text())
            time.sleep(0.1)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


def _over_http(server: _Server, args: argparse.Namespace) -> Callable[[str], Run]:
    import httpx

    def run(method: str) -> Run:
        extra = {"method": method} if method == "vanilla" else {"method": method, "n": args.n}

        async def main() -> tuple[float, list[float], int, int]:
            limits = httpx.Limits(
                max_connections=args.clients, max_keepalive_connections=args.clients
            )
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=600) as http:

                async def ask(i: int, q: testbed.Question) -> tuple[str, int]:
                    body = {"model": "testbed", "prompt": q.prompt, "seed": i, **extra, **SAMPLING}
                    response = await http.post("/v1/completions", json=body)
                    response.raise_for_status()
                    reply = response.json()
                    return reply["choices"][0]["text"], reply["usage"]["completion_tokens"]

                return await _closed_loop(args.clients, args.requests, ask)

        wall, latencies, tokens, correct = asyncio.run(main())
        return Run(method, "http", wall, tuple(latencies), tokens, correct)

    return run


def _report(runs: list[Run], methods: list[str], modes: list[str]) -> None:
    """Medians over rounds; ``vs driver`` is the median of each round's ratio to the
    ``driver`` run of the same round (paired, so that slow drift of a noisy
    machine cancels out)."""
    print(
        f"\n{'method':>8} {'mode':>8} {'req/s':>7} {'tok/s':>7} {'P50 s':>7} {'P97 s':>7} "
        f"{'acc %':>6} {'vs driver':>9}   (medians over rounds)"
    )
    for method in methods:
        base = [r for r in runs if r.method == method and r.mode == "driver"]
        for mode in modes:
            mine = [r for r in runs if r.method == method and r.mode == mode]
            if not mine:
                continue
            rps = statistics.median(r.rps for r in mine)
            tps = statistics.median(r.tokens / r.wall for r in mine)
            p50 = statistics.median(percentile(list(r.latencies), 50) for r in mine)
            p97 = statistics.median(percentile(list(r.latencies), 97) for r in mine)
            acc = 100 * sum(r.correct for r in mine) / sum(len(r.latencies) for r in mine)
            paired = [r.rps / b.rps for r, b in zip(mine, base)]
            ratio = f"{statistics.median(paired):9.3f}" if len(paired) == len(mine) else ""
            print(
                f"{method:>8} {mode:>8} {rps:7.2f} {tps:7.0f} {p50:7.2f} {p97:7.2f} "
                f"{acc:6.1f} {ratio}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sart.serve.bench", description=__doc__)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4, help="per client (4)")
    parser.add_argument("--methods", nargs="+", default=["vanilla", "sc", "sart"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument("--n", type=int, default=8, help="branches of sc and sart (8)")
    parser.add_argument("--batch-size", type=int, default=64, help="B (64)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    # What ``sart serve --model testbed`` loads: the policy on transformers, the PRM in
    # a process of its own.
    model, prm_path, options = resolve_models(TESTBED, None, "qwen")
    spec = LoadSpec("hf", model, prm=prm_path, prm_options=options, batch_size=args.batch_size)
    runs: list[Run] = []
    server = _Server(args) if "http" in args.modes else None
    try:
        with load(spec) as loaded:
            engine, prm = loaded.engine, loaded.prm

            def build(mode: str, settings: argparse.Namespace) -> Callable[[str], Run]:
                if mode == "driver":
                    return _sync_driver(engine, prm, settings)
                if mode == "http":
                    assert server is not None  # started above when "http" is among the modes
                    return _over_http(server, settings)
                return _in_process(mode, engine, prm, settings)

            modes = {mode: build(mode, args) for mode in args.modes}
            warm = argparse.Namespace(**{**vars(args), "clients": 4, "requests": 1})
            for mode in args.modes:  # first calls pay one-off costs
                build(mode, warm)("sart")
            for round_ in range(args.rounds):
                for method in args.methods:
                    order = args.modes if round_ % 2 == 0 else args.modes[::-1]
                    for mode in order:
                        run = modes[mode](method)
                        runs.append(run)
                        print(
                            f"round {round_} {method:>8} {mode:>8}: {run.rps:6.2f} req/s, "
                            f"{run.wall:6.1f} s",
                            flush=True,
                        )
    finally:
        if server is not None:
            server.close()
    _report(runs, args.methods, args.modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
