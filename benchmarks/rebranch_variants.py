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
"""

from __future__ import annotations

import attrs

import sart
from sart.methods import OPTIONS, register_method


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
for _busy in sart.policies.reward_balance.BUSY:
    _reshare(f"rb-busy-{_busy}", sart.WeightedVote(), busy=_busy)

if __name__ == "__main__":
    import sys

    from sart.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
