"""Memory of ``sart serve`` under sustained load: the server's RSS as requests pile up.

Starts sart's server app (``create_app``, uvicorn, the real HTTP layer and
driver) on 127.0.0.1 in a child process, on sart's ``FakeEngine`` and
``ScriptedPRM`` (short branches, a little wall time per decode step), and sends
it requests with the official ``openai`` client from 8 threads: SART, SC,
Rebase and Vanilla, every seventh streamed, every thirteenth a client that
leaves before its answer. After each mark it prints the server's RSS, the time
per request, and how many more objects the server's garbage collector tracks
than at the first mark: a server that keeps something per finished request
grows here.

    OMP_NUM_THREADS=1 python benchmarks/serve_memory.py                     # to 3,000 requests
    OMP_NUM_THREADS=1 python benchmarks/serve_memory.py --marks 500 5000 10000
    python benchmarks/serve_memory.py --quick                               # CI: 100, 300
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MODEL = "fake"
KEY = "key"


def serve(port: int, counts: Path) -> None:
    """The child: the app on the fake engine; SIGUSR1 writes its gc object count."""
    import uvicorn

    from sart.serve import Backend, ServeConfig, create_app
    from sart.testing import BranchScript, FakeEngine, ScriptedPRM

    class Engine(FakeEngine):
        def step(self, max_steps: int, until_first_end: bool = False) -> Any:
            output = super().step(min(max_steps, 8), until_first_end)
            self.log.clear()  # the fake's record of its calls, for tests: not the server's
            time.sleep(0.0005 * output.steps)
            return output

    class PRM(ScriptedPRM):
        def release(self, request_id: str) -> None:
            super().release(request_id)
            self.released.clear()  # likewise the fake's record

    def script(branch: Any) -> BranchScript:
        return BranchScript(
            length=24 + 9 * branch.index,
            answer=str(branch.index % 2),
            rewards=(0.3 + 0.1 * (branch.index % 6),),
            text="step one\n\nstep two ",
        )

    def count(signum: int, frame: Any) -> None:
        gc.collect()
        with counts.open("a") as f:
            f.write(f"{len(gc.get_objects())}\n")

    signal.signal(signal.SIGUSR1, count)
    config = ServeConfig(models=(MODEL,), api_key=KEY, n=4, interval=8, max_queue=10_000)
    app = create_app(config, Backend(Engine(script), PRM(script, every=8)))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load(marks: list[int], counts: Path) -> None:
    import httpx
    import openai

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), str(counts)],
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        methods = ["sart", "sc", "vanilla", "rebase", "sart"]

        def one(i: int) -> None:
            method = methods[i % len(methods)]
            extra = {"method": method} | ({} if method == "vanilla" else {"n": 4})
            if i % 13 == 6:  # a client that leaves before its answer
                try:
                    httpx.post(
                        f"{url}/v1/completions",
                        json={"model": MODEL, "prompt": "x", "max_tokens": 10**6},
                        headers={"Authorization": f"Bearer {KEY}"},
                        timeout=0.05,
                    )
                except httpx.TimeoutException:
                    pass
            elif i % 7 == 3:
                for _ in client.completions.create(
                    model=MODEL, prompt=f"q{i}", stream=True, extra_body=extra
                ):
                    pass
            else:
                client.completions.create(model=MODEL, prompt=f"q{i}", extra_body=extra)

        print(f"{'requests':>9} {'RSS MB':>7} {'ms/req':>7} {'gc objects':>11}")
        done, first = 0, None
        with ThreadPoolExecutor(8) as pool:
            for mark in marks:
                start = time.perf_counter()
                list(pool.map(one, range(done, mark)))
                per = 1000 * (time.perf_counter() - start) / (mark - done)
                done = mark
                time.sleep(1.0)  # the leavers' cancellations settle
                lines = len(counts.read_text().splitlines())
                server.send_signal(signal.SIGUSR1)
                while len(counts.read_text().splitlines()) == lines:
                    time.sleep(0.05)
                objects = int(counts.read_text().splitlines()[-1])
                first = objects if first is None else first
                print(
                    f"{mark:>9} {rss_mb(server.pid):>7.1f} {per:>7.1f} {objects - first:>+11,}",
                    flush=True,
                )
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--marks", type=int, nargs="+", default=[500, 1000, 2000, 3000])
    parser.add_argument("--quick", action="store_true", help="marks 100 and 300")
    args = parser.parse_args()
    marks = [100, 300] if args.quick else sorted(args.marks)
    counts = Path(os.environ.get("TMPDIR", "/tmp")) / f"sart-serve-memory-{os.getpid()}.txt"
    counts.write_text("")
    try:
        load(marks, counts)
    finally:
        counts.unlink()


if __name__ == "__main__":
    main()
