"""What the gateway costs: ``vllm bench serve`` against a ``vllm serve`` directly and
through ``sart serve --engine openai --method vanilla`` in front of it.

Starts one ``vllm serve`` of the tiny demo policy (built into a temporary
directory) and a gateway in front of it, both on loopback, then runs vLLM's own
load generator (``scripts/vllm_bench_serve.py``: ``vllm bench serve`` from its
module) against each, alternately, ``--repeats`` times: ``--prompts`` random
prompts of ``--input-len`` tokens at ``--concurrency`` in flight, each asking
for exactly ``--output-len`` tokens (``ignore_eos``). With ``vanilla`` every
request is one completion upstream, so the difference is the gateway's own
cost (HTTP in and out, the scheduler, the driver). Reported per target:
requests and output tokens per second, the median time to the first token
(the gateway streams a vanilla request as it is made), and P50/P99 end-to-end
latency; then
the throughput ratio (gateway / direct) and the latency it adds, from the
medians over the repeats. ``--stream-interval`` is passed to ``vllm serve``:
tokens per streamed chunk, which the gateway parses one by one.

Needs vLLM (the CI's ``.ci-vllm-venv``):

    OMP_NUM_THREADS=1 .ci-vllm-venv/bin/python benchmarks/gateway_overhead.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sart.demo_models import build_demo_models

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from adapters import vllm_serve  # noqa: E402
from serving import KEY, Server  # noqa: E402


def bench(
    url: str, tokenizer: Path, out: Path, args: argparse.Namespace, concurrency: int
) -> dict[str, float]:
    """One ``vllm bench serve`` run against ``url``: its throughputs and latencies."""
    command = [
        sys.executable, str(ROOT / "scripts" / "vllm_bench_serve.py"),
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "demo", "--tokenizer", str(tokenizer), "--ignore-eos",
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.prompts),
        "--max-concurrency", str(concurrency), "--seed", "0",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm", "--save-detailed",
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": KEY}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    if result["failed"]:
        errors = sorted({e for e in result["errors"] if e})
        raise SystemExit(f"{result['failed']} requests failed against {url}: {errors}")
    latencies = sorted(1000 * x for x in result["latencies"])
    return {
        "req/s": result["request_throughput"],
        "out tok/s": result["output_throughput"],
        "TTFT ms": 1000 * statistics.median(result["ttfts"]),
        "P50 ms": statistics.median(latencies),
        "P99 ms": latencies[min(len(latencies) - 1, round(0.99 * len(latencies)) - 1)],
        "duration s": result["duration"],
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process under it, alive now (from
    ``/proc``: Linux)."""
    import psutil  # vLLM's own dependency

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


class CpuBusy:
    """Samples how busy ``cpus`` are (``/proc/stat``, every ``period`` s) while it runs,
    so that a window of the run (the load, not the client's start-up) can be read back."""

    def __init__(self, cpus: list[int], period: float = 0.05) -> None:
        self.cpus = {f"cpu{c}" for c in cpus}
        self.period = period
        self.samples: list[tuple[float, float, float]] = []  # (time, busy, total) jiffies
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple[float, float, float]:
        busy = total = 0.0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name in self.cpus:
                    values = [float(v) for v in fields[:8]]
                    idle = values[3] + values[4]  # idle, iowait
                    total += sum(values)
                    busy += sum(values) - idle
        return time.monotonic(), busy, total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._read())
            self._stop.wait(self.period)

    def __enter__(self) -> CpuBusy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._read())

    def share(self, start: float, end: float) -> float:
        """The busy share of the CPUs between ``start`` and ``end`` (monotonic seconds)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return math.nan
        (_, b0, t0), (_, b1, t1) = inside[0], inside[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else math.nan


def pin(pid: int, cpus: list[int], tree: bool = True) -> None:
    """Run every thread of ``pid`` (and, with ``tree``, of every process under it) on
    ``cpus`` only; threads and processes started later inherit it."""
    import psutil

    root = psutil.Process(pid)
    for proc in [root, *(root.children(recursive=True) if tree else ())]:
        for thread in proc.threads():
            os.sched_setaffinity(thread.id, cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[32],
        help="requests in flight (several: "
        "a table for each, and --plot draws throughput against them)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the upstream's --stream-interval: tokens per streamed chunk (vLLM's default 1)",
    )
    parser.add_argument(
        "--gateway-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more flag for sart serve (repeat it; e.g. --gateway-flag=--admission=token)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="vllm serve on the first CPU, the gateway and the load generator on the others "
        "(as in a deployment, where the gateway does not share the upstream's cores)",
    )
    args = parser.parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--pin needs two CPUs at least")
    work = Path(tempfile.mkdtemp(prefix="sart-gateway-overhead-"))
    policy = build_demo_models(work / "models")["policy"]
    upstream_flags = ["--stream-interval", str(args.stream_interval)]
    handles: list[Any] = []
    with vllm_serve(policy, work / "vllm-serve.log", *upstream_flags, handles=handles) as upstream:
        pids = {"gateway": 0, "vllm serve": handles[0].pid}
        cpus = sorted(os.sched_getaffinity(0))
        if args.pin:
            pin(handles[0].pid, cpus[:1])
            pin(os.getpid(), cpus[1:], tree=False)  # the gateway and the client inherit it
        gateway = Server(
            "--engine", "openai", "--upstream", upstream, "--model", "demo",
            "--tokenizer", str(policy), "--api-key", KEY, "--method", "vanilla",
            "--max-tokens", str(args.output_len), "--max-tokens-limit", "4000",
            "--batch-size", str(max(args.concurrency)), "--max-queue", str(args.prompts),
            *args.gateway_flag,
        )  # fmt: skip
        pids["gateway"] = gateway.process.pid
        try:
            runs: dict[tuple[int, str], list[dict[str, float]]] = {}
            for repeat in range(args.repeats):  # alternately: the machine is shared
                for level in args.concurrency:
                    for name, url in (("direct", upstream), ("through sart", gateway.url)):
                        out = work / f"{name.replace(' ', '-')}-{level}-{repeat}.json"
                        before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                        with CpuBusy(cpus[1:] if args.pin else cpus) as busy:
                            row = bench(url, policy, out, args, level)
                            end = time.monotonic()
                        # The client's load, not its start-up: the last ``duration`` seconds.
                        row["busy"] = busy.share(end - row["duration s"], end)
                        # CPU per request of the gateway's process and of vllm serve's (all
                        # its processes), over the run (the load generator's start included).
                        for k, pid in pids.items():
                            row[f"{k} cpu"] = 1000 * (cpu_seconds(pid) - before[k]) / args.prompts
                        runs.setdefault((level, name), []).append(row)
        finally:
            code, log = gateway.stop()
            (work / "gateway.log").write_text(log)
        if code != 0:
            raise SystemExit(f"the gateway exited {code}:\n{log[-2000:]}")
    keys = (
        *("req/s", "out tok/s", "TTFT ms", "P50 ms", "P99 ms"),
        *("gateway cpu", "vllm serve cpu", "busy"),
    )
    median = {
        run: {k: statistics.median(r[k] for r in rows) for k in keys} for run, rows in runs.items()
    }
    for level in args.concurrency:
        print(
            f"vllm serve and sart serve --engine openai --method vanilla in front of it: "
            f"{args.prompts} prompts, {level} in flight, {args.input_len} in / "
            f"{args.output_len} out tokens, {args.stream_interval} tokens per upstream chunk, "
            f"median of {args.repeats} alternate runs"
            + (f"; vllm serve on CPU {cpus[0]}, the rest on {cpus[1:]}" if args.pin else "")
        )
        print(
            f"{'':>14}" + "".join(f"{k:>12}" for k in keys[:5]) + "  CPU ms/request: gateway, vllm"
        )
        for name in ("direct", "through sart"):
            row = median[level, name]
            cpu = f"  {row[keys[5]]:8.1f} {row[keys[6]]:8.1f}"
            print(f"{name:>14}" + "".join(f"{row[k]:>12,.1f}" for k in keys[:5]) + cpu)
        direct, gate = median[level, "direct"], median[level, "through sart"]
        print(
            f"gateway / direct throughput {gate['req/s'] / direct['req/s']:.2f}; added latency "
            f"TTFT {gate['TTFT ms'] - direct['TTFT ms']:+,.1f} ms, P50 "
            f"{gate['P50 ms'] - direct['P50 ms']:+,.1f} ms, P99 "
            f"{gate['P99 ms'] - direct['P99 ms']:+,.1f} ms"
        )
        if args.pin:
            print(account(direct, gate, cpus[1:]))
    if args.plot is not None:
        plot(args.plot, args, median)
        print(f"figure: {args.plot}")


def account(direct: dict[str, float], gate: dict[str, float], rest: list[int]) -> str:
    """Pinned, the CPUs besides vLLM's hold the client and the gateway: how busy they
    were during the load, and the throughput they allow through the gateway if the
    client costs per request what it cost directly (a ceiling, in CPU seconds)."""
    client = 1000 * direct["busy"] * len(rest) / direct["req/s"]  # ms of CPU per request
    ceiling = 1000 * len(rest) / (client + gate["gateway cpu"])
    return (
        f"CPU {rest} busy during the load: direct {direct['busy']:.0%}, through sart "
        f"{gate['busy']:.0%}; the client {client:.1f} ms + the gateway "
        f"{gate['gateway cpu']:.1f} ms of CPU per request there allow at most "
        f"{ceiling:,.1f} req/s through sart ({gate['req/s'] / ceiling:.2f} of it reached)"
    )


def plot(path: Path, args: argparse.Namespace, median: dict[tuple[int, str], Any]) -> None:
    """Requests per second against requests in flight, direct and through the gateway."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("direct", "o-"), ("through sart", "s--")):
        ax.plot(
            args.concurrency,
            [median[level, name]["req/s"] for level in args.concurrency],
            style,
            label=name if name == "direct" else "through sart serve (vanilla)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.concurrency, [str(level) for level in args.concurrency])
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("requests / s")
    ax.set_title(
        f"vllm serve, directly and through the gateway\n({args.prompts} prompts, "
        f"{args.input_len} in / {args.output_len} out, median of {args.repeats})",
        fontsize=10,
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
