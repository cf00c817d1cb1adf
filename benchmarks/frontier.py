"""Draw the accuracy-latency frontier from kept benchmark runs, and print it.

    python benchmarks/frontier.py DIR [DIR ...] --out FIGURE.png [--only RATE:METHOD:N ...]

Reads every run in each ``DIR/runs.jsonl`` (or ``runs.jsonl.gz``, as the runs under
``benchmarks/runs/`` are kept), keeps those ``--only`` names (all by default), and
draws ``sart bench``'s ``frontier.png`` from them: accuracy against P97 (top) and
against tokens per request (bottom), one panel per rate, the line joining the runs
nothing beats on both. ``sart bench`` draws it from the runs of one benchmark's
grid (every method at every N); this draws it from any runs measured side by side,
such as a few baselines re-measured beside a new method on the same machine the
same day (docs/testbed.md, "Prune and re-branch"). The table lists each run and the
runs that beat it on both accuracy and P97.

``--quick`` (CI) serves a small simulator benchmark into a temporary directory and
draws its frontier.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from sart.bench.frontier import dominated_by, label, plot_frontier
from sart.bench.plots import pyplot
from sart.bench.run_log import RUN_LOG, RunLog
from sart.bench.runner import RunRecord


def load(folder: Path) -> list[RunRecord]:
    """The runs kept in ``folder`` (its ``runs.jsonl``, else its ``runs.jsonl.gz``)."""
    if (folder / RUN_LOG).exists():
        return RunLog(folder).read()
    packed = folder / f"{RUN_LOG}.gz"
    if not packed.exists():
        raise SystemExit(f"{folder}: no {RUN_LOG} or {RUN_LOG}.gz")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / RUN_LOG).write_bytes(gzip.decompress(packed.read_bytes()))
        return RunLog(Path(tmp)).read()


def wanted(only: list[str]) -> set[tuple[float, str, int]]:
    keys = set()
    for spec in only:
        rate, method, n = spec.split(":")
        keys.add((float(rate), method, int(n)))
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=Path("frontier.png"))
    parser.add_argument("--only", nargs="+", default=[], metavar="RATE:METHOD:N")
    parser.add_argument("--quick", action="store_true", help="a small simulator benchmark")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folders = list(args.folders)
        if args.quick:
            bench = [sys.executable, "-m", "sart.cli", "bench", "--requests", "12", "--n", "2", "4"]
            bench += ["--rate", "2", "--methods", "sart", "rebase", "sart-rebranch", "--no-plots"]
            subprocess.run([*bench, "--out", tmp, "--json"], check=True, capture_output=True)
            folders.append(Path(tmp))
        records = [r for folder in folders for r in load(folder)]
        keys = wanted(args.only)
        if keys:
            records = [r for r in records if (r.rate, r.method, r.n) in keys]
            missing = keys - {(r.rate, r.method, r.n) for r in records}
            if missing:
                raise SystemExit(f"no such runs: {sorted(missing)}")
        if not records:
            raise SystemExit("no runs to draw")
        # Latencies in seconds (the simulator's too, by its default cost model).
        path = plot_frontier(pyplot(), SimpleNamespace(cost="s"), records, args.out)
    print(f"{'rate':>5} {'run':<18} {'acc %':>6} {'P97':>8} {'tokens':>8}  beaten by")
    for r in sorted(records, key=lambda r: (r.rate or 0.0, r.method, r.n)):
        s = r.summary
        better = ", ".join(label(b) for b in dominated_by(r, records)) or "-"
        print(
            f"{r.rate or 0:>5g} {label(r):<18} {100 * s.accuracy:>6.1f} "
            f"{s.e2e.p97:>8.2f} {s.tokens_per_request:>8,.0f}  {better}"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
