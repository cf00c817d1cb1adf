"""Overlapped checks, command by command: a ``Score`` in flight while decoding goes on.

Each test drives a ``Scheduler`` by hand with ``Scoring.OVERLAPPED``, holding a
``Score`` unanswered across later batches and answering it by id, to pin what
happens to its rewards when the branches or the request changed meanwhile.
"""

from __future__ import annotations

import pytest

import sart
from sart.commands import (
    Abort,
    Decode,
    Decoded,
    Done,
    Failed,
    Finish,
    Prefilled,
    ReleasePrefix,
    Score,
    Scored,
    Started,
)
from sart.engines.base import BranchDelta, StepOutput
from sart.types import BranchId, BranchStatus, FinishReason

S = BranchStatus


def answer_all(sched: sart.Scheduler, cmds: list, now: float) -> None:
    """Answer cleanup and admission commands (everything but decodes and scores)."""
    events = {}
    for cmd in cmds:
        if isinstance(cmd, (Abort, ReleasePrefix, Finish)):
            events[cmd.id] = Done()
        elif isinstance(cmd, sart.commands.Prefill):
            events[cmd.id] = Prefilled(3)
        elif isinstance(cmd, sart.commands.StartBranches):
            events[cmd.id] = Started()
    if events:
        sched.handle(events, now)


def started(policy: sart.Policy, scoring: sart.Scoring = sart.Scoring.OVERLAPPED, n_req: int = 1):
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=8, scoring=scoring, poll_steps=2))
    for i in range(n_req):
        sched.submit(sart.Request(f"r{i}", "q", policy))
    answer_all(sched, sched.next_commands(0.0), 0.0)
    return sched


def decode(sched: sart.Scheduler, now: float, deltas: dict, steps: int | None = None) -> Decode:
    """Emit the next batch, which must be one Decode; answer it with ``deltas``."""
    (cmd,) = sched.next_commands(now)
    assert isinstance(cmd, Decode), cmd
    out = StepOutput(steps or cmd.max_steps, deltas)
    sched.handle({cmd.id: Decoded(out)}, now)
    return cmd


def grow(request: str, branches: range, tokens: int) -> dict:
    return {BranchId(request, j): BranchDelta(tokens, "x " * tokens) for j in branches}


POLICY = sart.sart(4, m=2, alpha=0.5, beta=3, interval=4)


def test_decoding_goes_on_while_a_score_is_in_flight() -> None:
    sched = started(POLICY)
    assert decode(sched, 4.0, grow("r0", range(4), 4)) == Decode(max_steps=4)
    (score,) = sched.next_commands(4.0)
    assert isinstance(score, Score)
    assert sched.scoring_in_flight
    assert [(i.branch.index, i.num_tokens) for i in score.items] == [(j, 4) for j in range(4)]
    # Not answered, yet decoding goes on, in chunks of poll_steps; the check that comes
    # due meanwhile waits for the PRM (one Score in flight at a time).
    assert decode(sched, 6.0, grow("r0", range(4), 2)) == Decode(max_steps=2)
    assert decode(sched, 8.0, grow("r0", range(4), 2)) == Decode(max_steps=2)
    # Rewards of the snapshot (4 tokens) arrive: branches 1 and 3 are below alpha.
    rewards = {BranchId("r0", j): r for j, r in enumerate((0.9, 0.1, 0.8, 0.2))}
    sched.handle({score.id: Scored(rewards)}, 8.0)
    cmds = sched.next_commands(8.0)
    assert isinstance(cmds[0], Abort)
    assert set(cmds[0].branches) == {BranchId("r0", 1), BranchId("r0", 3)}
    # The branches have 8 tokens now; the rewards are recorded at the snapshot's 4, and
    # the check that came due meanwhile is sent at once with the current lengths.
    assert isinstance(cmds[-1], Score)
    assert [(i.branch.index, i.num_tokens) for i in cmds[-1].items] == [(0, 8), (2, 8)]


def test_a_branch_that_ended_meanwhile_is_not_pruned_and_waits_for_its_final_reward() -> None:
    sched = started(POLICY)
    decode(sched, 4.0, grow("r0", range(4), 4))
    (score,) = sched.next_commands(4.0)
    # Meanwhile branch 1 (low reward to come) completes, branch 3 too.
    ended = {
        **grow("r0", (0, 2), 1),
        BranchId("r0", 1): BranchDelta(1, " \\boxed{7}", FinishReason.STOP, 1),
        BranchId("r0", 3): BranchDelta(1, " \\boxed{7}", FinishReason.STOP, 1),
    }
    decode(sched, 5.0, ended, steps=1)
    rewards = {BranchId("r0", j): r for j, r in enumerate((0.9, 0.1, 0.8, 0.2))}
    sched.handle({score.id: Scored(rewards)}, 5.0)
    # No prune (the low ones are not running) and no finish (m=2 completed, but their
    # final rewards are unknown): the next Score carries the two final items.
    (final,) = sched.next_commands(5.0)
    assert isinstance(final, Score)
    assert [(i.branch.index, i.final) for i in final.items] == [(1, True), (3, True)]
    sched.handle({final.id: Scored({BranchId("r0", 1): 0.7, BranchId("r0", 3): 0.6})}, 6.0)
    cmds = sched.next_commands(6.0)
    assert [type(c) for c in cmds] == [Abort, ReleasePrefix, Finish]
    result = cmds[-1].result
    assert [b.status for b in result.branches] == [S.STOPPED, S.FINISHED, S.STOPPED, S.FINISHED]
    assert result.chosen == 1  # best final reward
    assert result.branches[1].reward_history == ((4, 0.1), (5, 0.7))


def test_late_rewards_of_a_finished_request_are_ignored() -> None:
    sched = started(POLICY, n_req=2)
    decode(sched, 4.0, {**grow("r0", range(4), 4), **grow("r1", range(4), 4)})
    (score,) = sched.next_commands(4.0)
    # A decode failure names r0: it fails while its check is in flight.
    (cmd,) = sched.next_commands(5.0)
    sched.handle({cmd.id: Failed("engine down", frozenset({"r0"}))}, 5.0)
    cleanup = sched.next_commands(5.0)
    assert [type(c) for c in cleanup] == [Abort, ReleasePrefix, Finish]
    assert cleanup[-1].result.status is sart.RequestStatus.FAILED
    answer_all(sched, cleanup, 5.0)
    rewards = {BranchId(r, j): 0.0 for r in ("r0", "r1") for j in range(4)}
    sched.handle({score.id: Scored(rewards)}, 6.0)
    cmds = sched.next_commands(6.0)
    # r1 prunes three (beta); nothing at all happens to r0.
    assert [type(c) for c in cmds] == [Abort]
    assert {b.request_id for b in cmds[0].branches} == {"r1"}
    assert len(cmds[0].branches) == 3


def test_blocking_scoring_emits_nothing_while_a_score_is_in_flight() -> None:
    sched = started(POLICY, scoring=sart.Scoring.BLOCKING)
    decode(sched, 4.0, grow("r0", range(4), 4))
    (score,) = sched.next_commands(4.0)
    assert isinstance(score, Score)
    assert sched.next_commands(4.0) == []
    assert not sched.idle
    sched.handle([Scored({BranchId("r0", j): 0.9 for j in range(4)})], 4.0)
    (cmd,) = sched.next_commands(4.0)
    assert cmd == Decode(max_steps=4)


def test_answers_must_name_commands_in_flight() -> None:
    sched = started(POLICY)
    decode(sched, 4.0, grow("r0", range(4), 4))
    (score,) = sched.next_commands(4.0)
    (cmd,) = sched.next_commands(4.0)
    with pytest.raises(sart.SchedulerError, match="not in flight"):
        sched.handle({cmd.id + 100: Done()}, 4.0)
    with pytest.raises(sart.SchedulerError, match="handle"):
        sched.next_commands(4.0)  # the Decode is not answered
    assert cmd.id > score.id


def test_poll_steps_is_validated() -> None:
    with pytest.raises(sart.ConfigError, match="poll_steps=0"):
        sart.SchedulerConfig(batch_size=2, poll_steps=0)
    with pytest.raises(sart.ConfigError, match="scoring"):
        sart.SchedulerConfig(batch_size=2, scoring="eventually")
