"""Re-branching variants compared on the developers' workload seed (``--seed 1``) to
choose ``sart-rebranch``'s defaults: SART with the seat-refilling ``Rebranch`` rule
(``rb-softmax``, ``rb-refill``, ...), and SART's stop over Rebase's re-sharing
(``rb-balance``, always; ``rb-reshare``, load-aware, which ``sart-rebranch`` became).
``sart bench`` with the variants registered as methods (names ``rb-*``); every argument
is ``sart bench``'s:

    python benchmarks/rebranch_variants.py --engine vllm --model testbed-long --seed 1 \
      --requests 60 --n 8 --rate 0.25 --batch-size 32 --vllm-arg enforce_eager=true \
      --methods sart rb-softmax rb-refill rb-late rb-balance

(or ``--plugin rebranch_variants`` with ``benchmarks`` on ``PYTHONPATH``).
docs/testbed.md gives the numbers and the choice. Not imported by sart itself.

``rb-agree-off`` and ``rb-agree3`` are ``sart-rebranch`` with its ``agree`` off (stop
only at M) and 3 (2 by default); ``rb-rows-off``, ``rb-rows0.5`` and ``rb-rows2`` are
``rb-agree-off`` with its ``row_budget`` off, 0.5 and 2 (1 by default). ``--cost-model cpu-testbed``
prices the simulator's steps as the long testbed's on transformers on this project's
CPU, where a row costs its own compute (``CPU_STEP``).

``--seeds K`` (first) serves the same benchmark with ``--seed 0`` to ``K - 1`` and
prints each method's means over the seeds beside the first method's (accuracy,
P97, tokens per request, and the P97 ratio's mean and largest), for the simulator,
where one seed's 200 requests move accuracy by several points:

    python benchmarks/rebranch_variants.py --seeds 10 \
      --workload benchmarks/runs/testbed-long-vllm/trace.jsonl.gz --batch-size 32 \
      --requests 200 --n 8 --rate 0.25 0.5 0.75 \
      --methods sart rb-agree-off sart-rebranch rb-agree3
"""

from __future__ import annotations

import attrs

import sart
from sart.engines.costs import PRESETS, compute_bound
from sart.methods import OPTIONS, register_method

CPU_STEP = (2.4e-3, 0.33e-3)
"""The long testbed's decode step on transformers on this project's 2-core machine,
fixed seconds and seconds a row, as the scheduler fits it (``benchmarks/step_cost.py``)."""

# ``--cost-model cpu-testbed``: the simulator with steps priced as that CPU's (no
# roofline: a row costs its own compute; no KV limit; the PRM unpriced).
PRESETS.setdefault("cpu-testbed", compute_bound("cpu-testbed", *CPU_STEP))


def _variant(name: str, label: str, **changes: object) -> None:
    def build(
        n: int, interval: int, m: int | None = None, alpha: float = 0.5, beta: int | None = None
    ) -> sart.Policy:
        policy = sart.sart(n, m=m, alpha=alpha, beta=beta, interval=interval)
        policy = attrs.evolve(policy, rebranch=sart.Rebranch())
        rule_changes = {k: v for k, v in changes.items() if k in attrs.fields_dict(sart.Rebranch)}
        other = {k: v for k, v in changes.items() if k not in rule_changes}
        policy = attrs.evolve(policy, rebranch=attrs.evolve(policy.rebranch, **rule_changes))
        return attrs.evolve(policy, **other, name=f"{name}(n={n})")

    register_method(name, build, label=label, short_label=name, options=OPTIONS)


_variant("rb-softmax", "re-branch: softmax 0.2, until 0.5 (the default)")
_variant("rb-refill", "re-branch: completed seats refilled too", refill_completed=True)
_variant("rb-wvote", "re-branch, reward-weighted vote", select=sart.WeightedVote())
_variant("rb-late", "re-branch: until 0.8", until=0.8)
_variant("rb-top", "re-branch: best parents first", parents="top")
_variant(
    "rb-refill-s2", "refill; no forks after 2 completions", refill_completed=True, stop_after=2
)
_variant("rb-refill-u25", "refill; parents up to 0.25", refill_completed=True, until=0.25)
_variant("rb-refill-wv", "refill; weighted vote", refill_completed=True, select=sart.WeightedVote())
_variant("rb-refill-sys", "refill; systematic", refill_completed=True, parents="systematic")


def _balance(
    n: int, interval: int, m: int | None = None, alpha: float = 0.5, beta: int | None = None
) -> sart.Policy:
    """Rebase's re-sharing with SART's early stop: FirstM(m) over RewardBalance."""
    m = max(1, n // 2) if m is None else m
    return sart.Policy(
        n=n,
        stop=sart.FirstM(m),
        prune=sart.RewardBalance(),
        select=sart.WeightedVote(),
        interval=interval,
        name=f"rb-balance(n={n},m={m})",
    )


register_method(
    "rb-balance",
    _balance,
    label="Rebase re-sharing, stop at M",
    short_label="rb-balance",
    options=OPTIONS,
)


def _reshare(
    name: str,
    select: sart.Selector,
    m_of: int = 2,
    temperature: float = 0.2,
    busy: str = "prune",
) -> None:
    """SART's stop at ``m = n / m_of`` over load-aware re-sharing (``Reshare``); ``busy``:
    what it does while others wait (``sart.Reshare.busy``; ``"prune"``, the first
    variants' behaviour)."""

    def build(
        n: int, interval: int, m: int | None = None, alpha: float = 0.5, beta: int | None = None
    ) -> sart.Policy:
        m = max(1, n // m_of) if m is None else m
        inner = sart.TwoPhasePrune(alpha, n // 2 if beta is None else beta)
        return sart.Policy(
            n=n,
            stop=sart.FirstM(m),
            prune=sart.Reshare(inner, temperature=temperature, busy=busy),
            select=select,
            interval=interval,
            name=f"{name}(n={n},m={m})",
        )

    register_method(name, build, label=name, short_label=name, options=OPTIONS)


_reshare("rb-reshare", sart.WeightedVote())
_reshare("rb-reshare-best", sart.BestReward())
_reshare("rb-reshare-m4", sart.WeightedVote(), m_of=4)
_reshare("rb-reshare-t05", sart.WeightedVote(), temperature=0.5)


def _rebranch_with(name: str, **options: float | int | None) -> None:
    """``sart-rebranch`` with other ``options`` (``row_budget``, ``agree``)."""

    def build(
        n: int, interval: int, m: int | None = None, alpha: float = 0.5, beta: int | None = None
    ) -> sart.Policy:
        policy = sart.sart_rebranch(n, m=m, alpha=alpha, beta=beta, interval=interval, **options)
        return attrs.evolve(policy, name=f"{name}(n={n})")

    register_method(name, build, label=name, short_label=name, options=OPTIONS)


# ``agree=None``: stop only at M, as ``sart-rebranch`` did before ``sart.Agreement``.
_rebranch_with("rb-agree-off", agree=None)
_rebranch_with("rb-agree3", agree=3)
# The row budget's variants, measured before the agreement stop (``row_budget=None``:
# as it was before compute counted as room); ``rb-agree-off`` is their row budget 1.
_rebranch_with("rb-rows-off", row_budget=None, agree=None)
_rebranch_with("rb-rows0.5", row_budget=0.5, agree=None)
_rebranch_with("rb-rows2", row_budget=2.0, agree=None)
for _busy in sart.policies.reward_balance.BUSY:
    _reshare(f"rb-busy-{_busy}", sart.WeightedVote(), busy=_busy)


def over_seeds(seeds: int, argv: list[str]) -> str:
    """``sart bench argv`` once per seed; each method's means, the first one's beside."""
    import contextlib
    import io
    import json
    import statistics

    from sart.cli import main

    runs: dict[tuple[float, str], list[dict]] = {}
    for seed in range(seeds):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["bench", *argv, "--seed", str(seed), "--json", "--no-plots"])
        if code:
            raise SystemExit(code)
        for run in json.loads(out.getvalue())["runs"]:
            runs.setdefault((run["rate"], run["method"]), []).append(run["summary"])
    lines = [
        f"means over seeds 0-{seeds - 1}; P97 ratio and accuracy gain against the first method",
        f"{'rate':>6} {'method':<18} {'acc %':>6} {'gain':>6} {'P97':>8} {'ratio':>6} "
        f"{'max':>6} {'tok/req':>8}",
    ]
    for rate in sorted({rate for rate, _ in runs}):
        methods = [m for r, m in runs if r == rate]
        first = runs[rate, methods[0]]
        for method in methods:
            rows = runs[rate, method]
            ratios = [r["e2e"]["p97"] / f["e2e"]["p97"] for r, f in zip(rows, first)]
            gain = [100 * (r["accuracy"] - f["accuracy"]) for r, f in zip(rows, first)]
            accuracy = 100 * statistics.fmean(r["accuracy"] for r in rows)
            lines.append(
                f"{rate:>6g} {method:<18} {accuracy:6.1f} {statistics.fmean(gain):+6.1f} "
                f"{statistics.fmean(r['e2e']['p97'] for r in rows):8.1f} "
                f"{statistics.fmean(ratios):6.2f} {max(ratios):6.2f} "
                f"{statistics.fmean(r['tokens_per_request'] for r in rows):8,.0f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    from sart.cli import main

    argv = sys.argv[1:]
    if argv[:1] == ["--seeds"]:
        print(over_seeds(int(argv[1]), argv[2:]))
    else:
        sys.exit(main(["bench", *argv]))
