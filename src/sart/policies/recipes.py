"""Ready-made policies: the paper's method and the baselines it is compared with."""

from __future__ import annotations

import functools

import attrs

from sart.confidence.scorer import ConfidenceScorer
from sart.confidence.signals import LowestGroupConfidence, LowestTokenLogprob, Signal
from sart.errors import config_check
from sart.policies.adaptive import BranchByLoad, ShedUnderLoad
from sart.policies.base import Policy
from sart.policies.particle import Resample
from sart.policies.prune import NoPrune, TwoPhasePrune, WarmupThreshold
from sart.policies.reward_balance import Reshare, RewardBalance
from sart.policies.select import BestReward, MajorityVote, WeightedVote
from sart.policies.stop import Agreement, AllDone, FirstM


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


def sart_adaptive(
    n: int,
    m: int | None = None,
    alpha: float = 0.5,
    beta: int | None = None,
    interval: int = 400,
    floor: int = 2,
    keep: int | None = None,
) -> Policy:
    """SART that branches by load, with ``n`` as its ceiling.

    When a request is admitted, ``BranchByLoad`` gives it between ``floor`` and ``n``
    branches: the batch slots free then, shared with the requests still queued
    (``sart.policies.adaptive.fair_share``). It is then served as ``sart(k, ...)``
    with ``m`` and ``beta`` at most ``k``'s (the paper's ``k/2`` when not given); and at
    each check where other work waits for a slot, ``ShedUnderLoad`` prunes its
    lowest-reward running branches down to ``keep`` (default: its ``m``, at most 2).
    Idle, it is SART at ``n``; saturated, SART at ``floor``.

    The defaults (``floor=2``, ``keep`` at most 2) were chosen on the simulator's
    gaokao workload on one H100 at 0.05 to 4 requests/s: a floor of 2 keeps SART's
    early stop (the shorter of two branches cuts the over-thinking tail) when the
    server is saturated, and shedding to 2 frees slots sooner than to ``m``.
    """
    config_check(isinstance(n, int) and n >= 1, "n", n, ">= 1")
    config_check(isinstance(floor, int) and 1 <= floor <= n, "floor", floor, f"in [1, n={n}]")
    # Checked at n, as sart(n, m) checks them: each admitted size then cuts them to fit.
    config_check(m is None or (_whole(m) and 1 <= m <= n), "m", m, f"None or in [1, n={n}]")
    config_check(keep is None or (_whole(keep) and keep >= 1), "keep", keep, "None or >= 1")
    build = functools.partial(
        _sart_shedding, m=m, alpha=alpha, beta=beta, interval=interval, keep=keep
    )
    return attrs.evolve(
        build(n),
        admit=BranchByLoad(floor=floor, build=build),
        name=f"sart-adaptive(n={floor}..{n})",
    )


def _sart_shedding(
    n: int, *, m: int | None, alpha: float, beta: int | None, interval: int, keep: int | None
) -> Policy:
    """SART at ``n`` (``m``, ``beta`` cut to fit it) that sheds branches under load."""
    m = _paper_m(n, None if m is None else min(m, n))
    beta = None if beta is None else min(beta, n - 1)
    policy = sart(n, m=m, alpha=alpha, beta=beta, interval=interval)
    shed = ShedUnderLoad(inner=policy.prune, keep=min(n, min(m, 2) if keep is None else keep))
    return attrs.evolve(policy, prune=shed)


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
    leaves, answering by reward-weighted vote. See ``sart.policies.reward_balance``."""
    return Policy(
        n=n,
        stop=AllDone(),
        prune=RewardBalance(temperature=temperature),
        select=WeightedVote(),
        interval=interval,
        name=f"rebase(n={n})",
    )


def sart_rebranch(
    n: int,
    m: int | None = None,
    alpha: float = 0.5,
    beta: int | None = None,
    interval: int = 400,
    temperature: float = 0.2,
    row_budget: float | None = 1.0,
    agree: int | None = 2,
) -> Policy:
    """SART that prunes *and* re-branches: ``n`` branches, stop once ``m`` complete
    (``n/2``) or sooner once ``agree`` finished branches agree on the answer
    (``sart.Agreement``; ``None``: only at ``m``), and at every check, while the
    server has room, Rebase's re-sharing of the running branches
    (``softmax(reward / temperature)``: the low ones pruned, the best forked into the
    slots they free); under load, the request shrinks as SART's two-phase pruning
    (``alpha``, ``beta``) would shrink it, and the slots it keeps are re-shared the
    same way (``sart.policies.reward_balance.Reshare``). The answer is the
    reward-weighted vote. Room includes compute: while the running branches add more
    than ``row_budget`` times a decode step's fixed cost (as the scheduler measures
    it: a CPU, not a GPU serving a large model), the request is under load too,
    shrinks as SART and re-shares what it keeps (``None``: rows are free).

    The defaults were chosen on the long testbed's developer seed (``--seed 1``, 60
    requests, N = 8, vLLM-CPU at 0.25 requests/s) among seat-refilling variants
    (``sart.Rebranch``) and this one, and what it does under load on vLLM-CPU at 1
    request/s; ``agree`` in the simulator replaying the long testbed's trace at three
    loads: docs/testbed.md gives the runs.
    """
    m = _paper_m(n, m)
    base = sart(n, m, alpha, beta, interval)
    # Agreement(m, k=m) stops exactly when FirstM(m) does: say so plainly.
    stop = base.stop if agree is None or agree >= m else Agreement(m, k=agree)
    return attrs.evolve(
        base,
        stop=stop,
        prune=Reshare(base.prune, temperature=temperature, row_budget=row_budget),
        select=WeightedVote(),
        name=f"sart-rebranch(n={n},m={m})",
    )


def particle_filter(n: int, interval: int = 400, temperature: float | None = None) -> Policy:
    """Particle filtering (Puri et al., 2025): ``n`` particles resampled by PRM weight at
    every check (systematic resampling), the best-rewarded completed one answers. See
    ``sart.policies.particle``."""
    return Policy(
        n=n,
        stop=AllDone(),
        prune=Resample(temperature=temperature),
        select=BestReward(),
        interval=interval,
        name=f"particle(n={n})",
    )


#: DeepConf's group window; the confidence recipes use ``min(interval, this)`` by default,
#: so that each check reads the tokens decoded since the last one.
DEEPCONF_WINDOW = 2048


def _window(window: int | None, interval: int) -> int:
    return min(interval, DEEPCONF_WINDOW) if window is None else window


def deepconf_online(
    n: int,
    warmup: int | None = None,
    keep: float = 90.0,
    interval: int = 400,
    window: int | None = None,
    top_k: int = 20,
) -> Policy:
    """DeepConf-online (Fu et al., 2025) on stock engines: ``n`` branches; once the first
    ``warmup`` complete (default ``max(1, n // 4)``), running branches whose lowest
    group confidence falls below the ``100 - keep`` percentile of theirs are aborted
    (``WarmupThreshold``); the answer is the confidence-weighted vote. Confidence comes
    from the policy's own top-``top_k`` log-probabilities (no PRM); ``window``
    defaults to ``min(interval, 2048)``.

    Differences from the paper's setting, kept on purpose: all ``n`` branches start
    together (the warm-up ones are simply the first to finish, not a separate
    first round), branches stop at checks every ``interval`` tokens rather than at
    the token where they fall below, and the vote weights are the confidence
    rewards (``ConfidenceScorer``'s map of ``C``) rather than ``C`` itself."""
    warmup = max(1, n // 4) if warmup is None else warmup
    signal = LowestGroupConfidence(window=_window(window, interval))
    return Policy(
        n=n,
        stop=AllDone(),
        prune=WarmupThreshold(warmup=warmup, keep=keep),
        select=WeightedVote(),
        interval=interval,
        name=f"deepconf-online(n={n},warmup={warmup},keep={keep:g})",
        reward=ConfidenceScorer(signal=signal, top_k=top_k),
    )


def sart_confidence(
    n: int,
    m: int | None = None,
    alpha: float = 0.5,
    beta: int | None = None,
    interval: int = 400,
    signal: Signal | None = None,
    top_k: int = 20,
    scale: float = 10.0,
) -> Policy:
    """SART with the policy's own confidence in place of a PRM: the paper's M-of-N stop
    and two-phase pruning (``sart()``'s defaults), the best-rewarded answer, rewards from
    ``signal`` (default ``LowestTokenLogprob()``: the lowest sampled-token probability
    so far, which needs no top-k). Phase 1 compares rewards with ``alpha``: for a
    confidence signal that depends on ``scale`` (``sart.confidence.signals``); phase 2
    compares branches with each other and does not."""
    m = _paper_m(n, m)
    signal = LowestTokenLogprob() if signal is None else signal
    return attrs.evolve(
        sart(n, m, alpha, beta, interval),
        name=f"sart-confidence(n={n},m={m})",
        reward=ConfidenceScorer(signal=signal, top_k=top_k, scale=scale),
    )


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
