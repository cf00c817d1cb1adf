"""What the gateway asks of ``vllm serve``: its request fields and its HTTP client, one at a time.

Starts one ``vllm serve`` of the tiny demo policy on loopback and streams
``--prompts`` completions of ``--output-len`` tokens (``ignore_eos``, a
32-token id prompt each) at ``--concurrency`` in flight, alternately
``--repeats`` times:

1. **Fields.** The bare body, then each field the gateway adds on its own
   (``temperature``/``top_p``, a ``seed`` per request, ``stream_options``
   with and without ``continuous_usage_stats``, ``return_token_ids``, an
   ``X-Request-Id`` header), then all of them: what the gateway sends for
   every branch. Sent with aiohttp.
2. **Client.** The gateway's full body through httpx's own connection pool,
   through httpx over aiohttp's connections (``AiohttpTransport``, the
   engine's default), and through aiohttp alone; each parses the stream
   with the engine's ``StreamParser``.

Reported per variant: requests/s, and CPU milliseconds per request of
``vllm serve``'s processes and (for the clients) of this process.

Needs vLLM (the CI's ``.ci-vllm-venv``):

    OMP_NUM_THREADS=1 .ci-vllm-venv/bin/python benchmarks/gateway_upstream.py
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from sart.demo_models import build_demo_models
from sart.engines.aiohttp_transport import AiohttpTransport
from sart.engines.openai_stream import Done, StreamParser

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gateway_overhead import cpu_seconds  # this script's directory

from adapters import vllm_serve

USAGE = {"include_usage": True}
FIELDS: dict[str, dict[str, Any]] = {
    "bare": {},
    "+temperature, top_p": {"temperature": 1.0, "top_p": 1.0},
    "+seed": {"seed": 0},
    "+include_usage": {"stream_options": USAGE},
    "+continuous_usage": {"stream_options": {**USAGE, "continuous_usage_stats": True}},
    "+return_token_ids": {"return_token_ids": True},
    "+X-Request-Id": {"_header": True},
}
GATEWAY = {
    "temperature": 1.0,
    "top_p": 1.0,
    "seed": 0,
    "n": 1,
    "stream_options": {**USAGE, "continuous_usage_stats": True},
    "return_token_ids": True,
    "_header": True,
}
FIELDS["all: the gateway's body"] = GATEWAY

Send = Callable[[str, dict[str, Any], dict[str, str]], Awaitable[object]]
"""Streams one request; returns its last event."""


def body(i: int, fields: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out = {
        "model": "demo",
        "prompt": [5 + (i * 7 + j) % 200 for j in range(32)],
        "max_tokens": args.output_len,
        "ignore_eos": True,
        "stream": True,
        **{k: v for k, v in fields.items() if not k.startswith("_")},
    }
    if "seed" in out:
        out["seed"] = i  # a seed of its own, as each branch has
    return out


async def load(url: str, fields: dict[str, Any], send: Send, args: argparse.Namespace) -> None:
    limit = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        headers = {"X-Request-Id": f"r{i}-{time.monotonic_ns()}"} if "_header" in fields else {}
        async with limit:
            last = await send(url + "/v1/completions", body(i, fields, args), headers)
            if not isinstance(last, Done):  # vLLM may merge tokens: count no events
                raise RuntimeError(f"request {i}'s stream ended with {last!r}, not [DONE]")

    await asyncio.gather(*(one(i) for i in range(args.prompts)))


async def with_aiohttp(url: str, fields: dict[str, Any], args: argparse.Namespace) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(to: str, data: dict[str, Any], headers: dict[str, str]) -> object:
            parser, last = StreamParser(), None
            async with session.post(to, json=data, headers=headers) as response:
                async for piece in response.content.iter_any():
                    last = ([last, *parser.feed(piece)])[-1]
            return last

        await load(url, fields, send, args)


async def with_httpx(url: str, fields: dict[str, Any], args: argparse.Namespace, aio: bool) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)  # the engine's
    transport = AiohttpTransport() if aio else None
    async with httpx.AsyncClient(limits=limits, timeout=60, transport=transport) as client:

        async def send(to: str, data: dict[str, Any], headers: dict[str, str]) -> object:
            parser, last = StreamParser(), None
            async with client.stream("POST", to, json=data, headers=headers) as response:
                async for piece in response.aiter_bytes():
                    last = ([last, *parser.feed(piece)])[-1]
            return last

        await load(url, fields, send, args)


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sart-gateway-upstream-"))
    policy = build_demo_models(work / "models")["policy"]
    handles: list[Any] = []
    variants: dict[str, Callable[[str], Awaitable[None]]] = {
        f"fields {name}": (lambda url, f=fields: with_aiohttp(url, f, args))
        for name, fields in FIELDS.items()
    }
    variants["client httpx pool"] = lambda url: with_httpx(url, GATEWAY, args, aio=False)
    variants["client httpx + aiohttp"] = lambda url: with_httpx(url, GATEWAY, args, aio=True)
    variants["client aiohttp"] = lambda url: with_aiohttp(url, GATEWAY, args)
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    with vllm_serve(policy, work / "vllm-serve.log", handles=handles) as url:
        asyncio.run(with_aiohttp(url, {}, args))  # warm up
        for _ in range(args.repeats):
            for name, run in variants.items():
                upstream, mine, start = cpu_seconds(handles[0].pid), own_cpu(), time.perf_counter()
                asyncio.run(run(url))
                wall = time.perf_counter() - start
                rows[name].append(
                    (
                        args.prompts / wall,
                        1000 * (cpu_seconds(handles[0].pid) - upstream) / args.prompts,
                        1000 * (own_cpu() - mine) / args.prompts,
                    )
                )
    print(
        f"vllm serve: {args.prompts} streamed completions, {args.concurrency} in flight, "
        f"32 in / {args.output_len} out tokens, median of {args.repeats}"
    )
    print(f"{'':>32}{'req/s':>10}{'vllm cpu ms/req':>17}{'client cpu ms/req':>19}")
    for name, got in rows.items():
        rate, upstream, mine = (statistics.median(x) for x in zip(*got))
        print(f"{name:>32}{rate:>10.1f}{upstream:>17.1f}{mine:>19.2f}")


if __name__ == "__main__":
    main()
