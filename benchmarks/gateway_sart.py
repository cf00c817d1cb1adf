"""SART through the gateway against SART on the same vLLM in process, on the long testbed.

Serves the long testbed's policy two ways, one after the other, and sends both
the same open-loop load (``--requests`` questions, Poisson arrivals at
``--rate`` per second, seeded) with the official ``openai`` client, each
request asking for SART with ``--n`` branches:

- ``in process``: ``sart serve --engine vllm-async --model testbed-long``
  (vLLM's ``AsyncLLM`` on the server's event loop, the testbed's PRM);
- ``gateway``: ``vllm serve`` of the same policy, and ``sart serve --engine
  openai`` in front of it with the same PRM and sampling.

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
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from sart import testbed as tb
from sart.testbed.specs import testbed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from adapters import VLLM_SERVER_ENV, vllm_serve
from serving import KEY, Server


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
    args = parser.parse_args()
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
    in_process = ("--engine", "vllm-async", "--model", "testbed-long", *common)
    with serving(work / "in-process.log", *in_process, env=VLLM_SERVER_ENV) as server:
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
            rows["gateway"] = asyncio.run(load(server.url, questions, args))
    print(
        f"SART N={args.n} on the long testbed: {args.requests} requests at {args.rate:g} req/s "
        f"(Poisson, seed {args.seed}), B = {args.batch_size}"
    )
    keys = ("accuracy", "req/s", "P50 s", "P97 s")
    print(f"{'':>12}" + "".join(f"{k:>10}" for k in keys))
    for name, row in rows.items():
        print(f"{name:>12}" + "".join(f"{row[k]:>10.2f}" for k in keys))
    ratio = rows["gateway"]["P97 s"] / rows["in process"]["P97 s"]
    print(f"gateway / in process P97 {ratio:.2f}")


if __name__ == "__main__":
    main()
