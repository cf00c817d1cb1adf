"""Peak memory and wall time of ``sart bench`` as the number of requests grows.

Runs ``sart bench --requests R`` (the simulator, every default method, N and rate)
in a child process per ``R``, as a user runs it, and prints its wall and CPU time, CPU time per
request and run (the default sweep serves 26 runs), peak RSS (the child's own,
from ``wait4``) and the size of what it wrote. Per-request time should stay flat
and memory should not grow with ``R`` beyond one run's working set (see
docs/tutorials/reproduce-in-simulation.md, "Large benchmarks").

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py                  # R = 250 1000 4000
    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py --plots          # with the figures
    python benchmarks/bench_memory.py --quick                            # CI: small, seconds
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(requests: int, extra: list[str], out: Path) -> tuple[float, float, float, int, int]:
    """``(wall s, CPU s, peak RSS MB, runs, bytes written)`` of one ``sart bench``."""
    command = [sys.executable, "-m", "sart.cli", "bench", "--requests", str(requests)]
    command += [*extra, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert child.stdout is not None
    printed = child.stdout.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"sart bench failed ({child.returncode}):\n{printed}")
    runs = int(printed.rsplit("ran ", 1)[1].split(" run", 1)[0])
    written = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, runs, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[250, 1000, 4000])
    parser.add_argument("--plots", action="store_true", help="draw the figures too")
    parser.add_argument(
        "--quick", action="store_true", help="R = 20 60, SART and SC at N = 2 4, 1 req/s"
    )
    args = parser.parse_args()
    extra = [] if args.plots else ["--no-plots"]
    sizes = args.requests
    if args.quick:
        sizes = [20, 60]
        extra += ["--methods", "sart", "sc", "--n", "2", "4", "--rate", "1"]
    print(f"sart bench {' '.join(extra) or '(defaults)'}")
    # Per request and run in CPU time: the wall time of a shared machine says more about
    # its other jobs.
    header = f"{'requests':>9} {'runs':>5} {'wall s':>8} {'CPU s':>8} {'CPU ms/req/run':>15}"
    print(f"{header} {'peak MB':>8} {'out MB':>7}")
    for requests in sizes:
        with tempfile.TemporaryDirectory(prefix="sart-bench-memory-") as out:
            wall, cpu, peak, runs, written = measure(requests, extra, Path(out))
        per = 1000 * cpu / (requests * runs)
        print(
            f"{requests:>9} {runs:>5} {wall:>8.1f} {cpu:>8.1f} {per:>15.2f} {peak:>8.0f} "
            f"{written / 1e6:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
