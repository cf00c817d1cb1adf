"""The gateway on real vLLM servers: prefix-cache hits by placement, and abort latency.

Starts two ``vllm serve`` of the tiny demo policy (built into a temporary
directory) on loopback, then measures, side by side in one run:

1. **Placement.** Self-Consistency (N branches, no PRM) over ``--requests``
   prompts that share nothing (a random preamble each, several KV blocks
   long), sent through ``OpenAIEngine`` to both servers, once with request
   affinity (every branch of a request on one server) and once per branch
   (each branch on the least-loaded server). Reported: vLLM's prefix-cache
   queries and hits (``vllm:prefix_cache_queries`` / ``_hits``, summed over
   both servers), the hit rate (and each server's), the share of the
   generated tokens the busier server made (0.5: an even split), and where
   each request's branches went; then the same requests on one server alone
   (``one``), whose hit rate each server's should match.
2. **Abort latency.** ``--width`` long branches (``ignore_eos``) on one
   server, all aborted as soon as each has streamed a token; reported: the
   tokens the server still generated after the abort call
   (``vllm:generation_tokens_total`` after the server went idle minus before
   the call), and the time until ``vllm:num_requests_running`` fell to 0;
   through a closed connection only (``explicit_abort=False``) and with
   vLLM's explicit abort endpoint (``--enable-scale-out``), on a quiet
   machine and with ``--burners`` busy processes competing for the CPUs.
3. **A replica that dies.** Self-Consistency over ``--requests`` long
   requests on both servers; ``--kill-after`` seconds in, the second server is
   killed. Reported: by the server each request lived on, how many failed and
   how many completed (only the killed server's should fail).

Needs vLLM (the CI's ``.ci-vllm-venv``):

    OMP_NUM_THREADS=1 .ci-vllm-venv/bin/python benchmarks/gateway.py
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

import sart
from sart.demo_models import build_demo_models
from sart.engines.openai import OpenAIEngine
from sart.engines.sync_bridge import SyncBridge
from sart.types import BranchId, SamplingSettings

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from adapters import vllm_serve_all

WORDS = "add the two numbers then check the sum carry one digit step result".split()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(words)) + f" Step 1: add {i} and 7."
        for i in range(count)
    ]


COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:generation_tokens_total",
)


def placement_run(urls: list[str], affinity: bool, args: argparse.Namespace, seed: int) -> dict:
    before = {u: [metric(u, name) for name in COUNTERS] for u in urls}
    engine = OpenAIEngine(urls, "demo", affinity=affinity)
    bridge = SyncBridge.build(lambda: engine)
    sampling = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens)
    requests = [
        sart.Request(f"r{i}", p, sart.self_consistency(args.n), sampling=sampling)
        for i, p in enumerate(prompts(args.requests, args.prompt_words, seed))
    ]
    wall = time.perf_counter()
    results = sart.run(requests, bridge, batch_size=args.n * 4)
    wall = time.perf_counter() - wall
    bridge.close()
    failed = [f"{r.request_id}: {r.reason}" for r in results if not r.ok]
    if failed:
        raise RuntimeError("requests failed: " + "; ".join(failed[:3]))
    spread = [len({engine.placement[BranchId(r.id, j)] for j in range(args.n)}) for r in requests]
    # Each server's prefix-cache queries, hits and generated tokens over the run.
    own = {u: [metric(u, name) - b for name, b in zip(COUNTERS, before[u])] for u in urls}
    queries = sum(q for q, _, _ in own.values())
    hits = sum(h for _, h, _ in own.values())
    made = [t for _, _, t in own.values()]
    return {
        "queries": queries,
        "hits": hits,
        "rate": hits / max(queries, 1),
        "rates": [h / max(q, 1) for q, h, _ in own.values()],
        "share": max(made) / max(sum(made), 1),
        "servers_per_request": sum(spread) / len(spread),
        "wall_s": wall,
    }


async def abort_once(url: str, explicit: bool, width: int) -> tuple[float, float]:
    engine = OpenAIEngine(url, "demo", extra_body={"ignore_eos": True}, explicit_abort=explicit)
    sampling = SamplingSettings(temperature=1.0, max_tokens=3500, seed=1)
    await engine.prefill("a", "Step 1: add 3 and 4.", sampling)
    await engine.start_branches("a", [sart.BranchSpec(j, 10 + j) for j in range(width)])
    await engine.step(1)
    made0 = metric(url, "vllm:generation_tokens_total")
    start = time.perf_counter()
    await engine.abort([BranchId("a", j) for j in range(width)])
    while metric(url, "vllm:num_requests_running") > 0:
        await asyncio.sleep(0.005)
    idle = time.perf_counter() - start
    await engine.release_prefix("a")
    await engine.aclose()
    await asyncio.sleep(0.5)  # the last iteration's counters
    return metric(url, "vllm:generation_tokens_total") - made0, idle


def kill_run(urls: list[str], victim: Any, args: argparse.Namespace) -> dict[str, int]:
    """Self-Consistency over ``--requests`` long requests on both servers (affinity);
    ``--kill-after`` seconds in, the second server's processes are killed (SIGKILL).
    Counts, by the server each request lived on, the requests that failed."""
    engine = OpenAIEngine(urls, "demo", extra_body={"ignore_eos": True})
    bridge = SyncBridge.build(lambda: engine)
    sampling = SamplingSettings(temperature=1.0, max_tokens=args.kill_tokens)
    requests = [
        sart.Request(f"k{i}", p, sart.self_consistency(args.n), sampling=sampling)
        for i, p in enumerate(prompts(args.requests, 20, seed=7))
    ]
    timer = threading.Timer(args.kill_after, os.killpg, (victim.pid, signal.SIGKILL))
    timer.start()
    try:
        results = sart.run(requests, bridge, batch_size=args.n * args.requests)
    finally:
        timer.cancel()
        bridge.close()
    counts = {"killed_failed": 0, "killed_ok": 0, "other_failed": 0, "other_ok": 0}
    for result in results:
        # Where its branches streamed last (a branch that had not streamed yet moved).
        where = {engine.placement[BranchId(result.request_id, j)] for j in range(args.n)}
        on_killed = urls[1] in where
        key = ("killed_" if on_killed else "other_") + ("ok" if result.ok else "failed")
        counts[key] += 1
    return counts


def burn(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--kill-tokens", type=int, default=600)
    parser.add_argument("--kill-after", type=float, default=3.0)
    parser.add_argument("--only", choices=["placement", "abort", "kill"], default=None)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = build_demo_models(tmp)["policy"]
    # The tests' `vllm serve` of the demo policy (tests/adapters.py), twice, with vLLM's
    # explicit abort endpoint; started side by side.
    flags = ("--enable-scale-out",)
    handles: list[Any] = []
    with vllm_serve_all([(model, tmp / f"{s}.log", flags) for s in "ab"], handles) as (one, two):
        print(
            f"servers {one} {two}; N={args.n}, {args.requests} requests of "
            f"~{args.prompt_words} words",
            flush=True,
        )
        for rep in range(args.repeats if args.only in (None, "placement") else 0):
            runs = [
                ([one, two], True, "request"),
                ([one, two], False, "branch "),
                ([one], True, "one    "),
            ]
            for index, (urls, affinity, name) in enumerate(runs):
                # Prompts of their own in each run: none is in a server's cache already.
                got = placement_run(urls, affinity, args, seed=1000 * rep + index)
                rates = " ".join(f"{r:.3f}" for r in got["rates"])
                print(
                    f"placement={name} hits {got['hits']:7.0f} / {got['queries']:7.0f} "
                    f"tokens = {got['rate']:.3f} (per server {rates}); generated tokens on "
                    f"the busier server {got['share']:.1%}; servers per request "
                    f"{got['servers_per_request']:.2f}; {got['wall_s']:.1f} s",
                    flush=True,
                )
        for burners in (0, args.burners) if args.only in (None, "abort") else ():
            stop = multiprocessing.Event()
            procs = [multiprocessing.Process(target=burn, args=(stop,)) for _ in range(burners)]
            for p in procs:
                p.start()
            try:
                for explicit in (False, True):
                    rows = [
                        asyncio.run(abort_once(one, explicit, args.width))
                        for _ in range(args.repeats)
                    ]
                    tokens = sorted(r[0] / args.width for r in rows)
                    idle = sorted(r[1] for r in rows)
                    how = "explicit  " if explicit else "disconnect"
                    print(
                        f"abort {how} burners={burners}: tokens per aborted branch after "
                        f"the call {[round(t) for t in tokens]}; idle after "
                        f"{[round(s * 1000) for s in idle]} ms",
                        flush=True,
                    )
            finally:
                stop.set()
                for p in procs:
                    p.join()
        if args.only in (None, "kill"):  # last: it kills the second server
            got = kill_run([one, two], handles[1], args)
            print(
                f"kill the second server after {args.kill_after:g} s: its requests "
                f"{got['killed_failed']} failed, {got['killed_ok']} completed; the other "
                f"server's {got['other_failed']} failed, {got['other_ok']} completed",
                flush=True,
            )


if __name__ == "__main__":
    main()
