"""Re-branching variants compared on the developers' workload seed (``--seed 1``) to
choose ``sart-rebranch``'s defaults. ``sart bench`` with the variants registered as
methods (names ``rb-*``); every argument is ``sart bench``'s:

    python benchmarks/rebranch_variants.py --engine vllm --model testbed-long --seed 1 \
      --requests 60 --n 8 --rate 0.25 --batch-size 32 --vllm-arg enforce_eager=true \
      --methods sart rb-softmax rb-refill rb-late rb-balance

(or ``--plugin rebranch_variants`` with ``benchmarks`` on ``PYTHONPATH``).
docs/testbed.md gives the numbers and the choice. Not imported by sart itself.
"""

from __future__ import annotations

import attrs

import sart
from sart.methods import OPTIONS, register_method


def _variant(name: str, label: str, **changes: object) -> None:
    def build(
        n: int, interval: int, m: int | None = None, alpha: float = 0.5, beta: int | None = None
    ) -> sart.Policy:
        policy = sart.sart_rebranch(n, m=m, alpha=alpha, beta=beta, interval=interval)
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

if __name__ == "__main__":
    import sys

    from sart.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
