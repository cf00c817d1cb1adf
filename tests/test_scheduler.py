"""Hand-computed checks of Algorithm 1 on small scripted scenarios.

Time is in decode steps (FakeEngine step_cost=1, prefill free), so every
expected number below can be worked out on paper; the comments do so.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

import sart
from sart.commands import (
    Abort,
    Decode,
    Decoded,
    Done,
    Failed,
    Finish,
    Prefill,
    Prefilled,
    ReleasePrefix,
    Score,
    Scored,
    Skipped,
    StartBranches,
    Started,
)
from sart.engines.base import BranchDelta, StepOutput
from sart.testing import BranchScript, FakeEngine, ScriptedPRM
from sart.types import BranchId, BranchStatus, FinishReason, Phase

S = BranchStatus


def statuses(result: sart.RequestResult) -> list[BranchStatus]:
    return [b.status for b in result.branches]


def run_until_step(driver: sart.SyncDriver, step: int) -> None:
    """Drive until ``step`` decode steps have run and the check after them is done."""
    while driver.scheduler.statistics().step < step:
        assert driver.step()
    while driver.scheduler._outbox or driver.scheduler._inflight:
        driver.step()


def test_two_phase_example_in_the_spirit_of_figure_4() -> None:
    # T=10, n=4, m=2, alpha=0.5, beta=2. Rewards r[j] hold after (j+1)*10 tokens.
    script = {
        "q": [
            BranchScript(length=25, answer="4", rewards=(0.6, 0.7, 0.8)),  # finishes at 25
            BranchScript(length=100, answer="5", rewards=(0.3, 0.4)),  # low from the start
            BranchScript(length=60, answer="5", rewards=(0.55, 0.6, 0.65, 0.7)),
            BranchScript(length=40, answer="4", rewards=(0.7, 0.9, 0.85, 0.9)),  # ends at 40
        ]
    }
    engine = FakeEngine(script)
    prm = ScriptedPRM(script, every=10)
    driver = sart.SyncDriver(engine, prm, batch_size=8)
    driver.submit(sart.Request("q", "2+2?", sart.sart(4, m=2, alpha=0.5, beta=2, interval=10)))

    # Check at step 10 (explore): rewards 0.6, 0.3, 0.55, 0.7 -> only branch 1 < alpha.
    run_until_step(driver, 10)
    meta = driver.scheduler.meta("q")
    assert (meta.phase, meta.threshold, meta.max_num_pruned) == (Phase.EXPLORE, 0.5, 2)
    assert meta.num_pruned == 1
    assert BranchId("q", 1) not in engine.live_branches
    # Step 20: 0.7, 0.6, 0.9: nothing below 0.5. Step 30: branch 0 finished at 25 with
    # final reward 0.8 -> exploit, threshold 0.8, up to n-1=3 pruned; branch 2 (0.65) goes.
    run_until_step(driver, 30)
    meta = driver.scheduler.meta("q")
    assert (meta.phase, meta.threshold, meta.max_num_pruned) == (Phase.EXPLOIT, 0.8, 3)
    assert (meta.num_completed, meta.num_pruned) == (1, 2)
    assert engine.live_branches == {BranchId("q", 3)}
    # Branch 3 ends at 40: two completed = m, the request finishes at 40.
    while driver.step():
        pass
    (result,) = driver.results
    assert statuses(result) == [S.FINISHED, S.PRUNED, S.PRUNED, S.FINISHED]
    assert [b.ended_in for b in result.branches] == [
        Phase.EXPLORE,
        Phase.EXPLORE,
        Phase.EXPLOIT,
        Phase.EXPLOIT,
    ]
    assert [b.num_tokens for b in result.branches] == [25, 10, 30, 40]
    assert result.chosen == 3  # final rewards 0.8 vs 0.9: best reward wins
    assert result.answer == "4"
    assert result.timings.finished == 40.0
    assert not engine.prefixes


def test_threshold_comes_from_earliest_completion_then_lowest_index() -> None:
    # Branches 1 and 2 both finish in the first chunk: 2 at step 3, 1 at step 5. The
    # threshold must be branch 2's final reward (0.2), so branch 0 (0.3) survives.
    script = {
        "q": [
            BranchScript(length=50, rewards=(0.3,)),
            BranchScript(length=5, final_reward=0.9),
            BranchScript(length=3, final_reward=0.2),
            BranchScript(length=50, rewards=(0.1,)),
        ]
    }
    engine = FakeEngine(script)
    results = sart.run(
        [sart.Request("q", "p", sart.sart(4, m=3, alpha=0.0, beta=0, interval=10))],
        engine,
        ScriptedPRM(script, every=10),
    )
    (result,) = results
    assert statuses(result)[3] is S.PRUNED  # 0.1 < 0.2
    assert statuses(result)[0] is S.FINISHED  # 0.3 >= 0.2, kept; finishes at 50
    assert result.num_pruned == 1


def test_same_step_completions_tie_break_by_lowest_index() -> None:
    script = {
        "q": [
            BranchScript(length=40, rewards=(0.5,)),
            BranchScript(length=4, final_reward=0.45),
            BranchScript(length=4, final_reward=0.9),
        ]
    }
    driver = sart.SyncDriver(FakeEngine(script), ScriptedPRM(script, every=10), batch_size=4)
    driver.submit(sart.Request("q", "p", sart.sart(3, m=3, alpha=0.0, beta=0, interval=10)))
    run_until_step(driver, 10)
    # Both ended at step 4; branch 1 has the lower index, so threshold = 0.45, and
    # branch 0 (0.5) is not pruned.
    assert driver.scheduler.meta("q").threshold == 0.45
    assert driver.scheduler.meta("q").num_pruned == 0


def test_phase_one_prunes_at_most_beta_lowest_first() -> None:
    rewards = [0.4, 0.1, 0.3, 0.2, 0.45, 0.9]
    script = {"q": [BranchScript(length=100, rewards=(r,)) for r in rewards]}
    driver = sart.SyncDriver(FakeEngine(script), ScriptedPRM(script, every=10), batch_size=8)
    driver.submit(sart.Request("q", "p", sart.sart(6, m=3, alpha=0.5, beta=3, interval=10)))
    run_until_step(driver, 10)
    live = {b.index for b in driver.engine.live_branches}
    assert live == {0, 4, 5}  # 0.1, 0.2, 0.3 pruned; 0.4 and 0.45 survive the beta cap
    while driver.step():  # nothing more is pruned in phase 1, ever
        pass
    assert driver.results[0].num_pruned == 3


def test_never_prunes_every_branch() -> None:
    # All rewards are below alpha and beta = n-1: one branch must survive and answer.
    script = {"q": [BranchScript(length=30, answer=str(j), rewards=(0.1,)) for j in range(3)]}
    (result,) = sart.run(
        [sart.Request("q", "p", sart.sart(3, m=1, alpha=0.5, beta=2, interval=10))],
        FakeEngine(script),
        ScriptedPRM(script, every=10),
    )
    assert result.ok
    assert result.num_pruned == 2
    assert result.num_completed == 1
    assert result.answer == "2"  # equal rewards are pruned lowest index first: 0, 1


def test_early_stop_after_m_stops_the_rest_and_releases_everything() -> None:
    lengths = [10, 20, 30, 400]
    script = {"q": [BranchScript(length=n, answer="7") for n in lengths]}
    engine = FakeEngine(script)
    (result,) = sart.run(
        [sart.Request("q", "p", sart.sart_without_pruning(4, m=2, interval=10))],
        engine,
        ScriptedPRM(script, every=10),
    )
    # Branch 1 finishes at step 20 = a check: m=2 reached, 2 and 3 are stopped then.
    assert statuses(result) == [S.FINISHED, S.FINISHED, S.STOPPED, S.STOPPED]
    assert [b.num_tokens for b in result.branches] == [10, 20, 20, 20]
    assert result.timings.end_to_end == 20.0
    assert ("abort", (BranchId("q", 2), BranchId("q", 3))) in engine.log
    assert engine.log[-1] == ("release", "q")
    assert not engine.live_branches and not engine.prefixes


def test_self_consistency_waits_for_all_and_votes() -> None:
    script = {
        "q": [
            BranchScript(length=5, answer="A"),
            BranchScript(length=50, answer="B"),
            BranchScript(length=9, answer="B"),
        ]
    }
    (result,) = sart.run(
        [sart.Request("q", "p", sart.self_consistency(3, interval=10))], FakeEngine(script)
    )
    assert statuses(result) == [S.FINISHED] * 3
    assert result.answer == "B"
    assert result.chosen == 2  # the first B to complete
    assert result.timings.finished == 50.0


def test_truncated_branches_count_as_completed() -> None:
    script = {"q": [BranchScript(length=100, answer="9")]}
    (result,) = sart.run(
        [sart.Request("q", "p", sart.vanilla(), sampling=sart.SamplingSettings(max_tokens=12))],
        FakeEngine(script),
    )
    assert statuses(result) == [S.TRUNCATED]
    assert result.branches[0].num_tokens == 12
    assert result.ok and result.chosen == 0


def test_eos_at_exactly_max_tokens_is_finished_not_truncated() -> None:
    script = {"q": [BranchScript(length=12)]}
    (result,) = sart.run(
        [sart.Request("q", "p", sart.vanilla(), sampling=sart.SamplingSettings(max_tokens=12))],
        FakeEngine(script),
    )
    assert statuses(result) == [S.FINISHED]


def test_admission_fills_from_branch_queue_before_prefilling() -> None:
    # B=3; three requests of n=2. Commands are checked one batch at a time.
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=3))
    policy = sart.self_consistency(2, interval=5)
    for rid in ("a", "b", "c"):
        sched.submit(sart.Request(rid, "p", policy, sampling=sart.SamplingSettings(seed=10)))
    cmds = sched.next_commands(0.0)
    assert [type(c) for c in cmds] == [Prefill, StartBranches, Prefill, StartBranches]
    assert [s.index for s in cmds[1].branches] == [0, 1]
    assert [(s.index, s.seed) for s in cmds[3].branches] == [(0, 10)]  # b1 waits in the queue
    sched.handle([Prefilled(3), Started(), Prefilled(3), Started()], 0.0)
    (decode,) = sched.next_commands(0.0)
    assert decode == Decode(max_steps=5)
    # a's two branches finish; b0 keeps going.
    sched.handle(
        [
            Decoded(
                StepOutput(
                    steps=5,
                    deltas={
                        BranchId("a", 0): BranchDelta(3, "x", FinishReason.STOP, 3),
                        BranchId("a", 1): BranchDelta(5, "y", FinishReason.STOP, 5),
                        BranchId("b", 0): BranchDelta(5, "zzzzz"),
                    },
                )
            )
        ],
        5.0,
    )
    cleanup = sched.next_commands(5.0)
    assert [type(c) for c in cleanup] == [ReleasePrefix, Finish]
    sched.handle([Done(), Done()], 5.0)
    # Two free slots: b1 (queued) first, then prefill c and start one of its branches.
    cmds = sched.next_commands(5.0)
    assert [type(c) for c in cmds] == [StartBranches, Prefill, StartBranches]
    assert cmds[0].request_id == "b" and [s.index for s in cmds[0].branches] == [1]
    assert cmds[1].request.id == "c" and [s.index for s in cmds[2].branches] == [0]
    assert sched.statistics().queued_requests == 0


def test_scheduler_refuses_out_of_protocol_calls() -> None:
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=2))
    with pytest.raises(sart.SchedulerError):
        sched.handle([], 0.0)
    sched.submit(sart.Request("a", "p", sart.vanilla()))
    cmds = sched.next_commands(0.0)
    with pytest.raises(sart.SchedulerError):
        sched.next_commands(0.0)
    with pytest.raises(sart.SchedulerError):
        sched.handle([Prefilled(1)], 0.0)  # two commands, one event
    assert len(cmds) == 2


def test_engine_reporting_an_unknown_branch_is_a_scheduler_error() -> None:
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=2))
    sched.submit(sart.Request("a", "p", sart.vanilla()))
    sched.next_commands(0.0)
    sched.handle([Prefilled(1), Started()], 0.0)
    sched.next_commands(0.0)
    with pytest.raises(sart.SchedulerError, match="not running"):
        sched.handle([Decoded(StepOutput(1, {BranchId("zz", 0): BranchDelta(1, "")}))], 1.0)


def test_prefill_failure_skips_its_start_and_fails_only_that_request() -> None:
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=4))
    sched.submit(sart.Request("a", "p", sart.self_consistency(2)))
    sched.submit(sart.Request("b", "p", sart.self_consistency(2)))
    sched.next_commands(0.0)
    sched.handle([Failed("boom"), Skipped(), Prefilled(1), Started()], 0.0)
    (finish,) = sched.next_commands(0.0)  # no prefix to release, no branch to abort
    assert isinstance(finish, Finish)
    assert finish.result.status is sart.RequestStatus.FAILED
    assert "prefill failed: boom" in (finish.result.reason or "")
    assert all(b.status is S.FAILED for b in finish.result.branches)
    sched.handle([Done()], 0.0)
    assert sched.statistics().running_branches == 2


def test_a_skipped_start_fails_its_request_and_releases_its_prefix() -> None:
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=4))
    sched.submit(sart.Request("a", "p", sart.self_consistency(2)))
    sched.submit(sart.Request("b", "p", sart.self_consistency(2)))
    sched.next_commands(0.0)
    # a's prefill went through, its start was skipped (a driver gave up on the batch).
    sched.handle([Prefilled(1), Skipped(), Prefilled(1), Started()], 0.0)
    release, finish = sched.next_commands(0.0)
    assert release == ReleasePrefix("a")
    assert isinstance(finish, Finish) and finish.result.status is sart.RequestStatus.FAILED
    assert "start skipped after an earlier failure" in (finish.result.reason or "")
    sched.handle([Done(), Done()], 0.0)
    assert sched.statistics().running_branches == 2  # b's, running on


def test_chunked_admission_waits_for_the_chunk_token_admission_does_not() -> None:
    script = {
        "r1": [BranchScript(length=5)],
        "r2": [BranchScript(length=50)],
        "r3": [BranchScript(length=5)],
    }

    def finish_of_r3(admission: sart.Admission) -> float:
        requests = [sart.Request(r, "p", sart.vanilla(interval=100)) for r in script]
        results = sart.run(requests, FakeEngine(script), batch_size=2, admission=admission)
        return results[2].timings.finished

    # Chunked: r3 waits until the chunk ends when r2 ends at 50, then needs 5 more.
    assert finish_of_r3(sart.Admission.CHUNK) == 55.0
    # Token-level: r1's slot is refilled at step 5, r3 ends at 10.
    assert finish_of_r3(sart.Admission.TOKEN) == 10.0


def test_token_admission_still_prunes_only_every_interval() -> None:
    script = {
        "q": [BranchScript(length=3, final_reward=0.9)]
        + [BranchScript(length=100, rewards=(0.8, 0.1)) for _ in range(3)]
    }
    prm = ScriptedPRM(script, every=10)
    driver = sart.SyncDriver(FakeEngine(script), prm, batch_size=4, admission=sart.Admission.TOKEN)
    driver.submit(sart.Request("q", "p", sart.sart(4, m=1, interval=10)))
    while driver.step():
        pass
    (result,) = driver.results
    # Branch 0 finishes at step 3 and m=1: the request ends right then, without
    # waiting for the check at step 10, and nothing was pruned.
    assert result.timings.finished == 3.0
    assert statuses(result) == [S.FINISHED, S.STOPPED, S.STOPPED, S.STOPPED]


def test_mixed_intervals_decode_until_the_next_due_check() -> None:
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=4))
    sched.submit(sart.Request("a", "p", sart.self_consistency(1, interval=7)))
    sched.submit(sart.Request("b", "p", sart.self_consistency(1, interval=3)))
    sched.next_commands(0.0)
    sched.handle([Prefilled(1), Started(), Prefilled(1), Started()], 0.0)
    assert sched.next_commands(0.0) == [Decode(max_steps=3)]
    sched.handle([Decoded(StepOutput(3, {}))], 3.0)
    assert sched.next_commands(3.0) == [Decode(max_steps=3)]
    sched.handle([Decoded(StepOutput(3, {}))], 6.0)
    assert sched.next_commands(6.0) == [Decode(max_steps=1)]  # a is due at 7


def test_vanilla_needs_no_prm_but_sart_does() -> None:
    engine = FakeEngine({"a": [BranchScript(length=3)]})
    assert sart.run([sart.Request("a", "p", sart.vanilla())], engine)[0].ok
    with pytest.raises(sart.ConfigError, match="needs PRM rewards"):
        sart.SyncDriver(FakeEngine(), batch_size=4).submit(sart.Request("b", "p", sart.sart(4)))


def test_duplicate_request_ids_in_flight_are_refused() -> None:
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=2))
    sched.submit(sart.Request("a", "p", sart.vanilla()))
    with pytest.raises(sart.ConfigError, match="id='a' must be unique"):
        sched.submit(sart.Request("a", "q", sart.vanilla()))


def test_score_items_cover_completions_and_due_running_branches() -> None:
    sched = sart.Scheduler(sart.SchedulerConfig(batch_size=4))
    sched.submit(sart.Request("a", "the prompt", sart.sart(3, interval=4)))
    sched.next_commands(0.0)
    sched.handle([Prefilled(2), Started()], 0.0)
    sched.next_commands(0.0)
    deltas = {
        BranchId("a", 0): BranchDelta(2, "ab", FinishReason.STOP, 2),
        BranchId("a", 1): BranchDelta(4, "abcd"),
        BranchId("a", 2): BranchDelta(4, "wxyz"),
    }
    sched.handle([Decoded(StepOutput(4, deltas))], 4.0)
    (score,) = sched.next_commands(4.0)
    assert isinstance(score, Score)
    assert [(i.branch.index, i.text, i.num_tokens, i.final) for i in score.items] == [
        (0, "ab", 2, True),
        (1, "abcd", 4, False),
        (2, "wxyz", 4, False),
    ]
    assert score.items[0].prompt == "the prompt"
    # A NaN fails the request with a reason naming the branch.
    sched.handle(
        [Scored({BranchId("a", 0): 0.9, BranchId("a", 1): float("nan"), BranchId("a", 2): 1.0})],
        4.0,
    )
    cmds = sched.next_commands(4.0)
    assert [type(c) for c in cmds] == [Abort, ReleasePrefix, Finish]
    assert "nan" in (cmds[-1].result.reason or "")


class PruneWorst(sart.PruneRule):
    def choose(self, request: sart.RequestView) -> list[int]:
        return [min(request.running, key=lambda b: b.reward or 0.0).index]


def test_running_branches_are_not_scored_once_the_prune_budget_is_spent() -> None:
    script = {
        "q": [BranchScript(length=40, rewards=(0.9,)), BranchScript(length=40, rewards=(0.1,))]
    }
    prm = ScriptedPRM(script, every=8)
    policy = sart.Policy(n=2, stop=sart.FirstM(1), prune=PruneWorst(), interval=8)
    (result,) = sart.run([sart.Request("q", "p", policy)], FakeEngine(script), prm)
    # Step 8: both scored, branch 1 pruned; the budget (n-1 = 1) is spent, so only
    # the final score of branch 0 follows.
    assert statuses(result) == [S.FINISHED, S.PRUNED]
    assert prm.items_scored == 3
    assert result.prm_items == 3


def test_beta_zero_scores_only_completions_until_exploit() -> None:
    script = {
        "q": [BranchScript(length=20, final_reward=0.9)]
        + [BranchScript(length=80, rewards=(0.1,)) for _ in range(2)]
    }
    prm = ScriptedPRM(script, every=10)
    (result,) = sart.run(
        [sart.Request("q", "p", sart.sart(3, m=2, alpha=0.5, beta=0, interval=10))],
        FakeEngine(script),
        prm,
    )
    # Check at 10: explore with beta=0 cannot prune, so nothing is scored. At 20
    # branch 0 completes: the phase may change, so it (final) and the two running
    # branches are scored; exploit sets threshold 0.9 and both 0.1 branches go.
    assert statuses(result) == [S.FINISHED, S.PRUNED, S.PRUNED]
    assert prm.items_scored == 3


def test_bad_prune_choices_fail_even_beyond_the_budget() -> None:
    class ThenGhost(sart.PruneRule):
        def choose(self, request: sart.RequestView) -> list[int]:
            return [b.index for b in request.running] + [99]

    script = {"q": [BranchScript(length=40, rewards=(0.5,))] * 2}
    policy = sart.Policy(n=2, prune=ThenGhost(), interval=8)
    (result,) = sart.run(
        [sart.Request("q", "p", policy)], FakeEngine(script), ScriptedPRM(script, every=8)
    )
    assert not result.ok
    assert "chose 99, not a branch index" in (result.reason or "")


def test_a_selector_that_chooses_no_completed_branch_fails_its_request_alone() -> None:
    class Ghost(sart.Selector):
        def choose(self, candidates: Sequence[sart.BranchView], answers: Sequence[str]) -> int:
            return 99

    script = {r: [BranchScript(length=8, answer="4")] * 2 for r in ("bad", "good")}
    bad = sart.Policy(n=2, select=Ghost(), interval=8)
    results = sart.run(
        [sart.Request("bad", "p", bad), sart.Request("good", "p", sart.Policy(n=2, interval=8))],
        FakeEngine(script),
        ScriptedPRM(script, every=8),
    )
    assert not results[0].ok
    assert "selector chose 99, not a completed branch" in (results[0].reason or "")
    assert results[1].ok and results[1].answer == "4"


class AbortFailsOnce(FakeEngine):
    """An engine whose first ``abort`` call raises (before changing anything)."""

    def __init__(self, *args: object, fail_times: int = 1, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fail_times = fail_times

    def abort(self, branch_ids):  # type: ignore[no-untyped-def]
        if self.fail_times:
            self.fail_times -= 1
            raise sart.EngineError("abort refused", {b.request_id for b in branch_ids})
        super().abort(branch_ids)


@pytest.mark.parametrize("fail_times", [1, 2, 10])
def test_a_failed_abort_is_retried_and_loses_no_result(fail_times: int) -> None:
    # Before: the engine kept decoding the branch the scheduler had ended, and the
    # next decode raised SchedulerError ("not running"), losing every result.
    script = {
        f"q{i}": [
            BranchScript(length=10 + 7 * j + i, answer="4", rewards=(0.9, 0.1)) for j in range(4)
        ]
        for i in range(3)
    }
    engine = AbortFailsOnce(script, max_branches=8, fail_times=fail_times)
    driver = sart.SyncDriver(engine, ScriptedPRM(script, every=5), batch_size=8)
    requests = [sart.Request(rid, "p", sart.sart(4, m=2, interval=5)) for rid in script]
    results = driver.run(requests)
    assert [r.request_id for r in results] == list(script)
    assert all(r.ok for r in results)
    failed = driver.scheduler.statistics().failed_cleanups
    assert engine.peak_live <= 8  # a branch whose abort failed still held its slot
    if fail_times <= sart.Scheduler.IDLE_ABORT_RETRIES:
        assert failed == fail_times
        # Retried until the engine let go, prefixes released after their branches.
        assert engine.live_branches == frozenset()
        assert engine.prefixes == frozenset()
    else:  # an engine that keeps refusing is given up on, the results kept
        assert 1 <= failed < fail_times


def test_a_branch_cut_at_max_tokens_answers_only_when_none_finished() -> None:
    # The cut branch has the best reward, and its extracted "answer" is its last words;
    # the finished one wrote its conclusion.
    script = {
        "a": [
            sart.testing.BranchScript(length=90, answer="7", rewards=(0.99,)),
            sart.testing.BranchScript(length=20, answer="4", rewards=(0.2,)),
        ],
        "b": [sart.testing.BranchScript(length=90, answer="7", rewards=(0.99,))],
    }
    policy = sart.Policy(n=2, stop=sart.AllDone(), select=sart.BestReward(), interval=10)
    requests = [
        sart.Request("a", "q", policy, sampling=sart.SamplingSettings(max_tokens=50)),
        sart.Request("b", "q", sart.vanilla(10), sampling=sart.SamplingSettings(max_tokens=50)),
    ]
    engine = sart.testing.FakeEngine(script)
    a, b = sart.run(requests, engine, sart.testing.ScriptedPRM(script, every=10))
    assert [x.status for x in a.branches] == [
        sart.BranchStatus.TRUNCATED,
        sart.BranchStatus.FINISHED,
    ]
    assert a.chosen == 1 and a.answer == "4"
    # Every completed branch still reports what was extracted from it.
    assert a.branches[0].answer is not None
    assert b.chosen == 0 and b.branches[0].status is sart.BranchStatus.TRUNCATED


def test_agreement_stops_at_the_first_check_where_two_finished_branches_agree() -> None:
    # Answers A (10 steps), B (20), A (30), B (40), C (400); m = 4, k = 2.
    # At the check after step 20 the two finished say A and B; after step 30, A twice:
    # the request stops there, where FirstM(4) would wait for step 40.
    answers = ["A", "B", "A", "B", "C"]
    lengths = [10, 20, 30, 40, 400]
    script = {"q": [BranchScript(length=n, answer=a) for n, a in zip(lengths, answers)]}
    policy = sart.Policy(n=5, stop=sart.Agreement(4), select=sart.MajorityVote(), interval=10)
    (result,) = sart.run([sart.Request("q", "p", policy)], FakeEngine(script))
    assert statuses(result) == [S.FINISHED] * 3 + [S.STOPPED] * 2
    assert result.timings.end_to_end == 30.0 and result.answer == "A"
    (waited,) = sart.run(
        [sart.Request("q", "p", attrs.evolve(policy, stop=sart.FirstM(4)))], FakeEngine(script)
    )
    assert waited.timings.end_to_end == 40.0


def test_agreement_reads_answers_by_the_policys_extract_once_per_branch() -> None:
    # "A" and "B" agree once the policy's extract says they are one answer; extract
    # runs once per completed branch, stop checks and selection together.
    script = {
        "q": [BranchScript(length=n, answer=a) for n, a in [(10, "A"), (20, "B"), (400, "C")]]
    }
    calls: list[str] = []

    def same(text: str) -> str:
        calls.append(text)
        return "same"

    policy = sart.Policy(
        n=3, stop=sart.Agreement(3), select=sart.MajorityVote(), interval=5, extract=same
    )
    (result,) = sart.run([sart.Request("q", "p", policy)], FakeEngine(script))
    assert statuses(result) == [S.FINISHED, S.FINISHED, S.STOPPED]
    assert result.timings.end_to_end == 20.0 and len(calls) == 2


def test_an_extract_that_raises_in_a_stop_check_fails_only_its_request() -> None:
    script = {
        rid: [BranchScript(length=10, answer="1"), BranchScript(length=50, answer="1")]
        for rid in ("bad", "good")
    }

    def broken(text: str) -> str:
        raise ValueError("no answer here")

    good = sart.Policy(n=2, stop=sart.Agreement(2), select=sart.MajorityVote(), interval=10)
    bad = attrs.evolve(good, extract=broken)
    engine = FakeEngine(script)
    results = sart.run([sart.Request("bad", "p", bad), sart.Request("good", "p", good)], engine)
    assert [r.ok for r in results] == [False, True]
    assert "no answer here" in (results[0].reason or "")
    assert not engine.live_branches and not engine.prefixes


class _Boom(RuntimeError):
    pass


class _AdmitRaises(sart.AdmitRule):
    def admit(self, policy: sart.Policy, load: sart.Load) -> sart.Policy:
        raise _Boom("my admit bug")


class _StartRaises(sart.TwoPhasePrune):
    def start(self, n: int) -> sart.Limits:
        raise _Boom("my start bug")


class _PauseNames99(sart.PauseRule):
    def choose(self, request: sart.RequestView) -> list[int]:
        return [99]


class _PauseRaises(sart.PauseRule):
    def choose(self, request: sart.RequestView) -> list[int]:
        raise _Boom("my pause bug")


@pytest.mark.parametrize(
    ("policy", "reason"),
    [
        (
            attrs.evolve(sart.sart(4, interval=8), admit=_AdmitRaises()),
            "_AdmitRaises.admit raised _Boom('my admit bug')",
        ),
        (
            attrs.evolve(sart.sart(4, interval=8), prune=_StartRaises(0.5, 2)),
            "_StartRaises.start raised _Boom('my start bug')",
        ),
    ],
)
def test_a_hook_that_fails_at_admission_fails_its_request_alone(
    policy: sart.Policy, reason: str
) -> None:
    # Its result is delivered (the run used to stop with it lost), and the request
    # admitted after it runs as if it were alone.
    script = {r: [BranchScript(length=20, answer="4", rewards=(0.5,))] * 4 for r in ("bad", "ok")}
    engine = FakeEngine(script)
    bad, ok = sart.run(
        [sart.Request("bad", "p", policy), sart.Request("ok", "p", sart.sart(4, interval=8))],
        engine,
        ScriptedPRM(script, every=8),
    )
    assert bad.status is sart.RequestStatus.FAILED and reason in (bad.reason or "")
    assert ok.ok and ok.answer == "4"
    assert engine.stats().live_branches == 0 and not engine.prefixes
    (alone,) = sart.run([sart.Request("bad", "p", policy)], FakeEngine(script), ScriptedPRM(script))
    assert alone.status is sart.RequestStatus.FAILED and reason in (alone.reason or "")


@pytest.mark.parametrize(
    ("rule", "reason"),
    [
        (_PauseNames99(), "pause rule chose 99, not a branch index"),
        (_PauseRaises(), "_PauseRaises.choose raised _Boom('my pause bug')"),
    ],
)
def test_a_pause_rule_that_fails_fails_its_request_alone(rule: sart.PauseRule, reason: str) -> None:
    # The failing request's branches are aborted before anything else is decoded (a
    # decode with them still running in the engine stopped every request).
    script: dict[str, list[BranchScript]] = {
        f"bulk{i}": [BranchScript(length=60, answer="1")] * 4 for i in range(2)
    }
    script["urgent"] = [BranchScript(length=20, answer="2")] * 2
    bulk = attrs.evolve(sart.self_consistency(4, interval=8), pause=rule)
    engine = FakeEngine(script)
    results = sart.run(
        [
            sart.Request("bulk0", "p", bulk, priority=1),
            sart.Request("bulk1", "p", sart.self_consistency(4, interval=8), priority=1),
            sart.Request("urgent", "p", sart.self_consistency(2, interval=8), arrival=3),
        ],
        engine,
        batch_size=8,
    )
    assert [r.status for r in results] == [
        sart.RequestStatus.FAILED,
        sart.RequestStatus.COMPLETED,
        sart.RequestStatus.COMPLETED,
    ]
    assert reason in (results[0].reason or "")
    assert engine.stats().live_branches == 0 and not engine.prefixes


def test_numpy_indices_and_limits_from_a_rule_are_taken() -> None:
    np = pytest.importorskip("numpy")

    class ArrayPrune(sart.TwoPhasePrune):
        def start(self, n: int) -> sart.Limits:
            return sart.Limits(threshold=np.float64(0.5), max_num_pruned=np.int64(2))

        def choose(self, request: sart.RequestView) -> list[int]:
            index = np.array([b.index for b in request.running])
            reward = np.array([b.reward for b in request.running], dtype=float)
            return list(index[reward < 0.5])

    script = {"q": [BranchScript(length=40, answer="4", rewards=(r,)) for r in (0.2, 0.9, 0.3)]}
    (result,) = sart.run(
        [sart.Request("q", "p", sart.Policy(n=3, prune=ArrayPrune(0.5, 2), interval=8))],
        FakeEngine(script),
        ScriptedPRM(script, every=8),
    )
    assert result.ok
    assert statuses(result) == [S.PRUNED, S.FINISHED, S.PRUNED]


def test_a_rule_that_names_a_branch_twice_is_told_so() -> None:
    class Twice(sart.PruneRule):
        def choose(self, request: sart.RequestView) -> list[int]:
            return [0, 0]

    script = {"q": [BranchScript(length=40, rewards=(0.5,))] * 2}
    (result,) = sart.run(
        [sart.Request("q", "p", sart.Policy(n=2, prune=Twice(), interval=8))],
        FakeEngine(script),
        ScriptedPRM(script, every=8),
    )
    assert "prune rule chose branch 0 twice" in (result.reason or "")


def test_a_selector_and_a_stop_rule_of_ones_own_get_rewards() -> None:
    # Read by default (needs_rewards), as a prune rule's are: a PRM scores the completed
    # branches though the policy (SC's) prunes nothing.
    class BestOfMine(sart.Selector):
        def choose(self, candidates: Sequence[sart.BranchView], answers: Sequence[str]) -> int:
            return max(candidates, key=lambda b: b.reward if b.reward is not None else -1).index

    class SureEnough(sart.StopRule):
        def should_stop(self, request: sart.RequestView) -> bool:
            return any((b.reward or 0) >= 0.6 for b in request.completed)

    script = {
        "q": [
            BranchScript(length=10 * (j + 2), answer=str(j), rewards=(r,))
            for j, r in enumerate((0.3, 0.7, 0.5, 0.9))
        ]
    }
    policy = attrs.evolve(sart.self_consistency(4, interval=8), select=BestOfMine())
    (picked,) = sart.run([sart.Request("q", "p", policy)], FakeEngine(script), ScriptedPRM(script))
    assert picked.answer == "3"
    policy = attrs.evolve(sart.self_consistency(4, interval=8), stop=SureEnough())
    (stopped,) = sart.run([sart.Request("q", "p", policy)], FakeEngine(script), ScriptedPRM(script))
    assert statuses(stopped) == [S.FINISHED, S.FINISHED, S.STOPPED, S.STOPPED]
    with pytest.raises(sart.ConfigError, match="its stop rule SureEnough reads them; a part of"):
        sart.run([sart.Request("q", "p", policy)], FakeEngine())


def test_a_failed_prefix_release_is_asked_again() -> None:
    class ReleaseFailsOnce(FakeEngine):
        failed = False

        def release_prefix(self, request_id: str) -> None:
            if not self.failed:
                self.failed = True
                raise sart.EngineError("not now", [request_id])
            super().release_prefix(request_id)

    script = {"q": [BranchScript(length=10, answer="4")] * 2}
    engine = ReleaseFailsOnce(script)
    driver = sart.SyncDriver(engine, batch_size=4)
    (result,) = driver.run([sart.Request("q", "p", sart.self_consistency(2, interval=8))])
    assert result.ok and not engine.prefixes
    assert driver.scheduler.statistics().failed_cleanups == 1
