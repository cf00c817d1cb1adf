"""Ready-made policies: the paper's method and the baselines it is compared with."""

from __future__ import annotations

from sart.errors import config_check
from sart.policies.base import Policy
from sart.policies.prune import NoPrune, TwoPhasePrune
from sart.policies.rebase import RewardBalance
from sart.policies.select import BestReward, MajorityVote, WeightedVote
from sart.policies.stop import AllDone, FirstM


def vanilla(interval: int = 400) -> Policy:
    """One branch, no PRM: plain reasoning (the paper's Vanilla baseline, ``N=1``)."""
    return Policy(
        n=1, stop=AllDone(), prune=NoPrune(), select=BestReward(), interval=interval, name="vanilla"
    )


def self_consistency(n: int, interval: int = 400) -> Policy:
    """``n`` branches, wait for all, majority vote (Wang et al., 2023)."""
    return Policy(
        n=n,
        stop=AllDone(),
        prune=NoPrune(),
        select=MajorityVote(),
        interval=interval,
        name=f"self-consistency(n={n})",
    )


def _paper_m(n: int, m: int | None) -> int:
    config_check(isinstance(n, int) and n >= 1, "n", n, ">= 1")
    return max(1, n // 2) if m is None else m


def sart(
    n: int,
    m: int | None = None,
    alpha: float = 0.5,
    beta: int | None = None,
    interval: int = 400,
) -> Policy:
    """SART: ``n`` branches, stop after ``m`` complete, two-phase pruning, best reward.

    Defaults are the paper's (section 5.1): ``m = n/2``, ``alpha = 0.5``,
    ``beta = n/2``, ``interval = T = 400`` (``n/2`` rounds down, and ``m`` is at
    least 1).
    """
    m = _paper_m(n, m)
    beta = n // 2 if beta is None else beta
    return Policy(
        n=n,
        stop=FirstM(m),
        prune=TwoPhasePrune(alpha=alpha, beta=beta),
        select=BestReward(),
        interval=interval,
        name=f"sart(n={n},m={m})",
    )


def sart_without_pruning(n: int, m: int | None = None, interval: int = 400) -> Policy:
    """The ablation "SART (w/o pruning)": redundant sampling with early stopping only."""
    m = _paper_m(n, m)
    return Policy(
        n=n,
        stop=FirstM(m),
        prune=NoPrune(),
        select=BestReward(),
        interval=interval,
        name=f"sart-no-prune(n={n},m={m})",
    )


def rebase(n: int, temperature: float = 0.2, interval: int = 400) -> Policy:
    """Rebase (Wu et al., 2024): reward-balanced tree search keeping at most ``n``
    leaves, answering by reward-weighted vote. See ``sart.policies.rebase``."""
    return Policy(
        n=n,
        stop=AllDone(),
        prune=RewardBalance(temperature=temperature),
        select=WeightedVote(),
        interval=interval,
        name=f"rebase(n={n})",
    )
