"""SART through the gateway against SART on the same vLLM in process, on the long testbed.

Serves the long testbed's policy two ways, one after the other, and sends both
the same open-loop load (``--requests`` questions, Poisson arrivals at
``--rate`` per second, seeded) with the official ``openai`` client, each
request asking for SART with ``--n`` branches:

- ``in process``: ``sart serve --engine vllm-async --model testbed-long``
  (vLLM's ``AsyncLLM`` on the server's event loop, the testbed's PRM);
- ``gateway``: ``vllm serve`` of the same policy, and ``sart serve --engine
  openai`` in front of it with the same PRM and sampling.

Both run vLLM with the same engine arguments (those of the tests' ``vllm serve``:
float32, eager, no chunked prefill...; the in-process engine gets them as
``--vllm-arg``), so what differs is the path, not the engine. With ``--pin`` the
processes that run the model (vLLM's engine core and worker) get the first CPU and
everything else the others (sart serve, its PRM process, vllm serve's API server,
the load generator), in both modes, as in a deployment where the model runs on its
accelerators and the gateway has CPUs of its own. Unpinned on a 2-core
machine the comparison measures the kernel's scheduler more than the gateway
(docs/how-to/gateway.md says what was measured).

Reported per mode: accuracy (the testbed's grader), requests per second, and
the P50 and P97 of end-to-end latency as the client sees it; then the
gateway's P97 over the in-process one.

Needs vLLM (the CI's ``.ci-vllm-venv``):

    OMP_NUM_THREADS=1 .ci-vllm-venv/bin/python benchmarks/gateway_sart.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil

from sart import testbed as tb
from sart.testbed.specs import testbed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gateway_overhead import pin

from adapters import VLLM_SERVE_ARGS, VLLM_SERVER_ENV, vllm_arg_flags, vllm_serve
from serving import KEY, Server

MODEL_PROCESSES = ("VLLM::EngineCore", "VLLM::Worker")
"""vLLM's processes that run the model (the names it gives them)."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def load(url: str, questions: list[Any], args: argparse.Namespace) -> dict[str, float]:
    """The open-loop load against ``url``: accuracy, throughput, P50 and P97 (s)."""
    # openai's own retries: a pooled connection that the server closed while idle (its
    # keep-alive timeout, as vllm serve's) is sent again, as any client does.
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=3600)
    model = (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    arrivals, now = [], 0.0
    for _ in questions:
        now += rng.expovariate(args.rate)
        arrivals.append(now)
    start = time.perf_counter()

    async def one(i: int, question: Any) -> tuple[float, bool]:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        sent = time.perf_counter()
        reply = await client.completions.create(
            model=model,
            prompt=question.prompt,
            seed=1000 + i,
            extra_body={"method": "sart", "n": args.n},
        )
        return time.perf_counter() - sent, tb.grade(question, reply.choices[0].text)

    done = await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))
    wall = time.perf_counter() - start
    await client.close()
    latencies = [t for t, _ in done]
    return {
        "accuracy": 100 * sum(ok for _, ok in done) / len(done),
        "req/s": len(done) / wall,
        "P50 s": statistics.median(latencies),
        "P97 s": percentile(latencies, 0.97),
    }


def pin_apart(cpus: list[int]) -> str:
    """Pin vLLM's model processes under this one to the first of ``cpus``, everything
    else under it to the others (``--pin``); says which process went where."""
    pin(os.getpid(), cpus[1:])
    model = [p for p in psutil.Process().children(recursive=True) if p.name() in MODEL_PROCESSES]
    if not model:
        raise SystemExit(f"--pin: found none of vLLM's {MODEL_PROCESSES} processes")
    for proc in model:
        pin(proc.pid, cpus[:1], tree=False)
    names = ", ".join(sorted({p.name() for p in model}))
    return f"{names} on CPU {cpus[0]}, the rest on {cpus[1:]}"


@contextlib.contextmanager
def serving(log: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """``sart serve`` with ``flags`` for the block; its output is kept in ``log``, and an
    exit code other than 0 ends the script with its tail."""
    server = Server(*flags, env=env)
    try:
        yield server
    finally:
        code, text = server.stop()
        log.write_text(text)
    if code != 0:
        raise SystemExit(f"sart serve {' '.join(flags[:2])} exited {code}:\n{text[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=0.25)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the testbed's")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="vLLM's model processes on the first CPU, everything else on the others",
    )
    args = parser.parse_args()
    # vLLM's engine core in a process of its own in both modes (vllm serve's layout),
    # whatever the caller's environment says.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    cpus = sorted(os.sched_getaffinity(0))  # before --pin takes the first from this process
    if args.pin and len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs at least")
    bed = testbed("testbed-long")
    assert bed is not None
    questions = bed.eval_questions(args.requests, seed=args.seed)
    work = Path(tempfile.mkdtemp(prefix="sart-gateway-sart-"))
    common = [
        "--api-key", KEY, "--method", "sart", "--n", str(args.n),
        "--batch-size", str(args.batch_size), "--max-queue", str(args.requests),
        "--max-tokens", str(args.max_tokens or bed.max_tokens),
        "--max-tokens-limit", str(args.max_tokens or bed.max_tokens),
        "--interval", str(bed.interval), "--temperature", "1.0", "--top-p", "1.0",
    ]  # fmt: skip
    rows: dict[str, dict[str, float]] = {}
    engine_args = vllm_arg_flags(VLLM_SERVE_ARGS)
    in_process = ("--engine", "vllm-async", "--model", "testbed-long", *engine_args, *common)
    with serving(work / "in-process.log", *in_process, env=VLLM_SERVER_ENV) as server:
        placed = pin_apart(cpus) if args.pin else ""
        rows["in process"] = asyncio.run(load(server.url, questions, args))
    # The policy's own context (its max_position_embeddings), as in process.
    config = json.loads((bed.policy_path / "config.json").read_text())
    context = ("--max-model-len", str(config["max_position_embeddings"]))
    with vllm_serve(bed.policy_path, work / "vllm-serve.log", *context) as upstream:
        gateway = (
            "--engine", "openai", "--upstream", upstream, "--model", "demo",
            "--tokenizer", str(bed.policy_path), "--prm", "testbed-long", *common,
        )  # fmt: skip
        with serving(work / "gateway.log", *gateway) as server:
            placed = pin_apart(cpus) if args.pin else ""
            rows["gateway"] = asyncio.run(load(server.url, questions, args))
    print(
        f"SART N={args.n} on the long testbed: {args.requests} requests at {args.rate:g} req/s "
        f"(Poisson, seed {args.seed}), B = {args.batch_size}; the same vLLM engine arguments"
        + (f"; {placed}" if placed else "; unpinned")
    )
    keys = ("accuracy", "req/s", "P50 s", "P97 s")
    print(f"{'':>12}" + "".join(f"{k:>10}" for k in keys))
    for name, row in rows.items():
        print(f"{name:>12}" + "".join(f"{row[k]:>10.2f}" for k in keys))
    ratio = rows["gateway"]["P97 s"] / rows["in process"]["P97 s"]
    print(f"gateway / in process P97 {ratio:.2f}")


if __name__ == "__main__":
    main()
