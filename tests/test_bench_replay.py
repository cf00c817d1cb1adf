"""Exact replays of small traces under the ``steps`` cost model, checked by hand and by property.

Under the ``steps`` model a decode step costs 1 and a prefill 0, so every
finish time below can be worked out on paper from Algorithm 1 with chunked
admission (the default):

- admission happens only between decode calls: free slots (``B`` minus the
  running branches) are filled first from the branch queue, then by
  prefilling the next arrived request (FCFS), whose branches beyond the free
  slots join the branch queue;
- a chunk ends after ``T`` steps, or as soon as every branch in the batch has
  ended; the next chunk then runs a full ``T`` steps again (every request is
  checked after every decode call, as in Algorithm 1);
- after each chunk, requests that are due (``T`` of their steps since their
  last check) or that had a branch end are checked: a first completion starts
  phase 2 with the threshold set to its final reward, due requests are
  pruned (lowest rewards first, at most ``beta`` in phase 1, up to ``n - 1``
  in phase 2), and a request finishes when ``m`` branches have completed or
  none is left, stopping the rest;
- ``ScriptedPRM(every=T)``: the reward after ``k`` tokens is
  ``rewards[ceil(k / T) - 1]`` (the last repeats) and ``final_reward`` once
  complete; ``BestReward`` picks the highest final reward.

The property tests then compare methods on random small traces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

import sart
from sart.bench.runner import BenchConfig, RunRecord, run_method
from sart.bench.traces import Trace, TraceRequest
from sart.engines.scripts import BranchScript
from sart.engines.sim import SimEngine
from sart.prm.scripted import ScriptedPRM
from sart.results import RequestResult
from sart.types import BranchStatus, Phase, SamplingSettings

S = BranchStatus
EXPLORE, EXPLOIT = Phase.EXPLORE, Phase.EXPLOIT

#: The workload presets' ``max_tokens``, which ``run_method`` applies to generated-style
#: configs; every length here is far below it, so no branch is truncated.
MAX_TOKENS = 16384


def examples(n: int) -> int:
    """``n`` examples, scaled up under ``pytest --slow`` (10x hypothesis' default)."""
    return n * max(1, settings.default.max_examples // 100)


# ------------------------------------------------------------------ helpers


def b(
    length: int, answer: str = "1", rewards: Sequence[float] = (), final: float | None = None
) -> BranchScript:
    return BranchScript(length=length, answer=answer, rewards=tuple(rewards), final_reward=final)


def request(
    rid: str, arrival: float, branches: Sequence[BranchScript], gold: str = "1"
) -> TraceRequest:
    return TraceRequest(
        id=rid, arrival=arrival, answer=gold, branches=tuple(branches), prompt_tokens=4
    )


def steps_config(interval: int, batch_size: int) -> BenchConfig:
    return BenchConfig(cost="steps", interval=interval, batch_size=batch_size)


def replay(trace: Trace, policy: sart.Policy, batch_size: int) -> list[RequestResult]:
    """Serve ``trace`` with ``policy`` on a ``steps`` SimEngine; results in trace order."""
    script = trace.script()
    engine = SimEngine(script, cost="steps")
    driver = sart.SyncDriver(
        engine, ScriptedPRM(script, every=policy.interval), batch_size=batch_size
    )
    results = driver.run(
        sart.Request(
            r.id,
            (0,) * r.prompt_tokens,
            policy,
            sampling=SamplingSettings(max_tokens=MAX_TOKENS),
            arrival=r.arrival,
        )
        for r in trace
    )
    assert not engine.live_branches and not engine.prefixes  # everything was freed
    assert engine.peak_live <= batch_size
    return results


def statuses(result: RequestResult) -> list[BranchStatus]:
    return [o.status for o in result.branches]


def tokens(result: RequestResult) -> list[int]:
    return [o.num_tokens for o in result.branches]


def phases(result: RequestResult) -> list[Phase | None]:
    return [o.ended_in for o in result.branches]


def times(result: RequestResult) -> tuple[float, float | None, float]:
    t = result.timings
    return (t.arrival, t.scheduled, t.finished)


def timeline(record: RunRecord) -> list[tuple[float, int, int]]:
    return [(s.time, s.running_branches, s.kv_tokens) for s in record.timeline]


# ------------------------------------------------------------------ hand-computed scenarios


def test_second_request_waits_for_batch_slots() -> None:
    # Self-Consistency, n=2, T=10, B=2. r0 arrives at 0, r1 at 5; prompts are 4 tokens.
    trace = Trace.of(
        [
            request("r0", 0.0, [b(12, "7"), b(25, "7")], gold="7"),
            request("r1", 5.0, [b(8, "3"), b(14, "4")], gold="3"),
        ]
    )
    record = run_method(trace, "sc", 2, steps_config(interval=10, batch_size=2))
    r0, r1 = record.results
    # t=0   r0 takes both slots. Chunk 0-10: nothing ends. r1 arrives at 5, mid-chunk.
    # t=10  no slot free (B=2): r1 waits in the request queue. Chunk 10-20: r0b0 ends at 12.
    # t=20  one slot: r1 is prefilled, r1b0 starts, r1b1 joins the branch queue.
    #       Chunk: r0b1 has 5 steps left, r1b0 8: every branch has ended after 8 -> t=28.
    # t=28  r0 is done: finished at 28. Majority "7"; the first "7" to complete is b0.
    #       r1b1 starts. Every branch ended early, so (Algorithm 1) the next chunk
    #       is a full 10 steps -> t=38 (check), then r1b1's last 4 tokens -> t=42.
    assert times(r0) == (0.0, 0.0, 28.0)
    assert times(r1) == (5.0, 20.0, 42.0)
    assert r1.timings.queueing == 15.0
    assert statuses(r0) == statuses(r1) == [S.FINISHED, S.FINISHED]
    assert tokens(r0) == [12, 25]
    assert tokens(r1) == [8, 14]
    assert (r0.chosen, r0.answer) == (0, "7")
    # r1: "3" and "4" tie 1-1; the answer that completed first (at 28) wins.
    assert (r1.chosen, r1.answer) == (0, "3")
    # After each decode call: (time, running branches, KV tokens = prefixes + branch tokens).
    assert timeline(record) == [
        (10.0, 2, 4 + 10 + 10),
        (20.0, 1, 4 + 20),  # r0b0 ended at 12 and freed its 12 tokens
        (28.0, 0, 4 + 4),  # r0's prefix is released only after its check
        (38.0, 1, 4 + 10),
        (42.0, 0, 4),
    ]
    summary = record.summary
    assert (summary.makespan, summary.accuracy, summary.peak_running_branches) == (42.0, 1.0, 2)
    assert summary.tokens_per_request == (37 + 22) / 2
    assert summary.e2e.max == 37.0


def test_sart_prunes_in_phase_one_and_again_in_phase_two() -> None:
    # sart(n=5, m=2, alpha=0.5, beta=1, T=10), one request, B=8.
    trace = Trace.of(
        [
            request(
                "q",
                0.0,
                [
                    b(60, "1", [0.2]),  # lowest at the first check
                    b(60, "2", [0.4, 0.6]),  # below alpha too, but beta=1
                    b(15, "3", [0.55], final=0.7),  # first completion
                    b(50, "4", [0.8, 0.65]),  # above alpha, below the exploit threshold
                    b(33, "5", [0.9], final=0.95),
                ],
                gold="5",
            )
        ]
    )
    policy = sart.sart(5, m=2, alpha=0.5, beta=1, interval=10)
    (q,) = replay(trace, policy, batch_size=8)
    # t=10  explore, threshold 0.5, budget 1: rewards .2 .4 .55 .8 .9; b0 and b1 are below
    #       alpha, only the lowest (b0) is pruned, with 10 tokens.
    # t=20  b2 completed at 15 with final reward 0.7: exploit, threshold 0.7, budget n-1=4.
    #       Running rewards: b1 .6, b3 .65, b4 .9 -> b1 and b3 pruned (20 tokens each);
    #       b3 is above alpha, so the raised threshold is what prunes it.
    # t=30  b4 (.9) is kept. The next chunk ends when b4, the only branch, ends at 33:
    #       m=2 completions, the request finishes at 33. Best final reward: b4 (.95 > .7).
    assert times(q) == (0.0, 0.0, 33.0)
    assert statuses(q) == [S.PRUNED, S.PRUNED, S.FINISHED, S.PRUNED, S.FINISHED]
    assert phases(q) == [EXPLORE, EXPLOIT, EXPLORE, EXPLOIT, EXPLOIT]
    assert tokens(q) == [10, 20, 15, 20, 33]
    assert [o.reward for o in q.branches] == [0.2, 0.6, 0.7, 0.65, 0.95]
    assert (q.chosen, q.answer) == (4, "5")
    # PRM items: 5 running at t=10; b2 (final) + 3 running at t=20; b4 at t=30 (budget
    # left); b4's final reward at 33.
    assert q.prm_items == 5 + 4 + 1 + 1


def test_alpha_zero_beta_zero_still_prunes_in_phase_two() -> None:
    # Phase 1 never prunes with alpha=0, but the first completion raises the threshold.
    trace = Trace.of([request("q", 0.0, [b(5, "1", final=0.9), b(30, "2", [0.3, 0.3])])])
    never = replay(trace, sart.sart(2, m=2, alpha=0.0, beta=0, interval=10), batch_size=2)
    # t=10: b0 completed at 5 (final 0.9) -> threshold 0.9 > b1's 0.3: b1 pruned; the
    # request has nothing left and finishes at 10 with b0's answer.
    (q,) = never
    assert statuses(q) == [S.FINISHED, S.PRUNED]
    assert phases(q) == [EXPLORE, EXPLOIT]
    assert times(q) == (0.0, 0.0, 10.0)
    (unpruned,) = replay(trace, sart.sart_without_pruning(2, m=2, interval=10), batch_size=2)
    assert statuses(unpruned) == [S.FINISHED, S.FINISHED]
    assert times(unpruned) == (0.0, 0.0, 30.0)


def test_early_stop_at_m_with_a_mid_chunk_arrival() -> None:
    # SART without pruning via the runner: n=4 -> m=2; T=10, B=8.
    trace = Trace.of(
        [
            request(
                "r0",
                0.0,
                [
                    b(40, "5", final=0.9),
                    b(12, "5", final=0.6),
                    b(27, "6", final=0.8),
                    b(18, "6", final=0.7),
                ],
                gold="6",
            ),
            request(
                "r1",
                7.0,
                [
                    b(9, "2", final=0.5),
                    b(50, "2", final=0.9),
                    b(22, "9", final=0.4),
                    b(31, "2", final=0.6),
                ],
                gold="2",
            ),
        ]
    )
    config = steps_config(interval=10, batch_size=8)
    r0, r1 = run_method(trace, "sart-no-prune", 4, config).results
    # t=0   r0 starts (r1 arrives at 7, mid-chunk, and waits for the chunk to end).
    # t=10  r1 is prefilled and starts its 4 branches.
    # t=20  r0: b1 completed at 12, b3 at 18 -> m=2: r0 finishes at 20, best of
    #       b1 (.6) and b3 (.7) is b3. b0 and b2 are stopped with 20 tokens.
    #       r1: b0 completed at 19 (9 tokens): one completion.
    # t=40  r1: b2 completed at 32 (22 tokens) -> m=2: finishes at 40, best of b0 (.5)
    #       and b2 (.4) is b0. b1 and b3 are stopped with 30 tokens.
    assert times(r0) == (0.0, 0.0, 20.0)
    assert statuses(r0) == [S.STOPPED, S.FINISHED, S.STOPPED, S.FINISHED]
    assert tokens(r0) == [20, 12, 20, 18]
    assert (r0.chosen, r0.answer) == (3, "6")
    assert times(r1) == (7.0, 10.0, 40.0)
    assert statuses(r1) == [S.FINISHED, S.STOPPED, S.FINISHED, S.STOPPED]
    assert tokens(r1) == [9, 30, 22, 30]
    assert (r1.chosen, r1.answer) == (0, "2")

    # Self-Consistency on the same trace waits for every branch: r0 until b0 ends at 40;
    # r1 (also admitted at 10) until b1 ends at 10 + 50 = 60. Majority vote: r0's "5"
    # and "6" tie 2-2 and "5" completed first (b1 at 12); r1 votes "2" 3-1, first b0.
    sc0, sc1 = run_method(trace, "sc", 4, config).results
    assert (times(sc0), times(sc1)) == ((0.0, 0.0, 40.0), (7.0, 10.0, 60.0))
    assert (sc0.generated_tokens, sc1.generated_tokens) == (97, 112)
    assert (r0.generated_tokens, r1.generated_tokens) == (70, 91)
    assert (sc0.answer, sc1.answer) == ("5", "2")


def test_pruning_frees_a_slot_for_a_queued_request() -> None:
    # sart(n=2) -> m=1, alpha=0.5, beta=1; T=10, B=2. Both requests arrive at 0.
    trace = Trace.of(
        [
            request("r0", 0.0, [b(50, "1", [0.2]), b(25, "1", [0.8], final=0.9)]),
            request("r1", 0.0, [b(12, "1", [0.6], final=0.4), b(6, "1", final=0.8)]),
        ]
    )
    config = steps_config(interval=10, batch_size=2)
    r0, r1 = run_method(trace, "sart", 2, config).results
    # t=10  r0b0 (.2 < .5) is pruned: its slot goes to r1 (prefilled, b0 starts, b1 waits).
    # t=20  r1b0's reward .6 >= .5: kept (r0's budget of 1 is spent: not scored).
    # t=25  every branch has ended (r1b0 at 22, r0b1 at 25): both requests finish at 25;
    #       r1 has m=1 completion, so its waiting b1 is stopped without ever starting.
    assert times(r0) == (0.0, 0.0, 25.0)
    assert times(r1) == (0.0, 10.0, 25.0)
    assert statuses(r0) == [S.PRUNED, S.FINISHED]
    assert statuses(r1) == [S.FINISHED, S.STOPPED]
    assert tokens(r0) == [10, 25]
    assert tokens(r1) == [12, 0]
    assert phases(r1) == [EXPLORE, None]
    # Self-Consistency keeps r0b0 to 50. r1 gets r0b1's slot only at the check after
    # r0b1 ends (25 -> t=30): r1b0 runs 30-42, r1b1 waits for r0b0's slot at 50, ends at 56.
    sc0, sc1 = run_method(trace, "sc", 2, config).results
    assert (times(sc0), times(sc1)) == ((0.0, 0.0, 50.0), (0.0, 30.0, 56.0))
    assert (tokens(sc0), tokens(sc1)) == ([50, 25], [12, 6])


def test_queueing_changes_what_sart_generates() -> None:
    # Why SART's tokens depend on B while Self-Consistency's do not: n=2, m=1.
    trace = Trace.of([request("q", 0.0, [b(50), b(5)])])
    policy = sart.sart_without_pruning(2, m=1, interval=10)
    # B=2: b1 completes at 5; at the check at 10, b0 is stopped: 10 + 5 tokens.
    (wide,) = replay(trace, policy, batch_size=2)
    assert (tokens(wide), wide.timings.finished) == ([10, 5], 10.0)
    # B=1: b0 runs alone to 50 and completes first; b1 never starts: 50 tokens.
    (narrow,) = replay(trace, policy, batch_size=1)
    assert (tokens(narrow), narrow.timings.finished) == ([50, 0], 50.0)
    assert statuses(narrow) == [S.FINISHED, S.STOPPED]
    # Self-Consistency generates every branch in full whatever B is.
    sc = sart.self_consistency(2, interval=10)
    assert [r.generated_tokens for B in (1, 2) for r in replay(trace, sc, B)] == [55, 55]


# ------------------------------------------------------------------ random small traces


@attrs.frozen
class Case:
    """A random small trace and the settings to replay it with."""

    trace: Trace
    n: int
    m: int
    alpha: float
    beta: int
    interval: int
    batch_size: int

    @property
    def total_branches(self) -> int:
        return sum(len(r.branches) for r in self.trace)


rewards = st.one_of(st.sampled_from((0.0, 0.25, 0.5, 0.75, 1.0)), st.floats(0.0, 1.0))

branch_scripts = st.builds(
    BranchScript,
    length=st.integers(1, 60),
    answer=st.sampled_from(("1", "2", "3")),
    rewards=st.lists(rewards, max_size=8).map(tuple),
    final_reward=st.none() | rewards,
    filler=st.just(""),
)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """1-4 requests of ``n`` (1-6) branches: lengths 1-60, rewards in [0, 1],
    arrivals 0-50; ``T`` 1-10, ``B`` 1-12; SART's ``m``, ``alpha``, ``beta``."""
    n = draw(st.integers(1, 6))
    count = draw(st.integers(1, 4))
    requests = [
        TraceRequest(
            id=f"r{i}",
            arrival=float(draw(st.integers(0, 50) | st.floats(0.0, 50.0))),
            answer="1",
            branches=tuple(draw(st.lists(branch_scripts, min_size=n, max_size=n))),
            prompt_tokens=draw(st.integers(1, 8)),
        )
        for i in range(count)
    ]
    return Case(
        trace=Trace.of(requests),
        n=n,
        m=draw(st.integers(1, n)),
        alpha=draw(rewards),
        beta=draw(st.integers(0, n - 1)),
        interval=draw(st.integers(1, 10)),
        batch_size=draw(st.integers(1, 12)),
    )


class NeverPrune(sart.PruneRule):
    """A prune rule that takes part in every check (so running branches are scored)
    and never chooses anything."""

    def choose(self, request: sart.RequestView) -> list[int]:
        return []


def signature(result: RequestResult) -> tuple:
    """Everything the schedule decides about a request (not the rewards it saw)."""
    return (
        result.request_id,
        result.status,
        times(result),
        [(o.status, o.num_tokens, o.ended_in) for o in result.branches],
        result.chosen,
        result.answer,
    )


def full_tokens(trace_request: TraceRequest) -> int:
    return sum(min(s.length, MAX_TOKENS) for s in trace_request.branches)


@settings(max_examples=examples(200))
@given(cases())
def test_a_prune_rule_that_never_fires_equals_sart_without_pruning(case: Case) -> None:
    never = sart.Policy(
        n=case.n,
        stop=sart.FirstM(case.m),
        prune=NeverPrune(),
        select=sart.BestReward(),
        interval=case.interval,
    )
    baseline = sart.sart_without_pruning(case.n, m=case.m, interval=case.interval)
    with_rule = replay(case.trace, never, case.batch_size)
    without = replay(case.trace, baseline, case.batch_size)
    assert [signature(r) for r in with_rule] == [signature(r) for r in without]
    assert all(r.ok for r in with_rule)
    # The rule takes part in the checks: its running branches are scored on top of the
    # completions both policies score.
    assert sum(r.prm_items for r in with_rule) >= sum(r.prm_items for r in without)


@settings(max_examples=examples(200))
@given(cases())
def test_alpha_zero_prunes_nothing_in_phase_one(case: Case) -> None:
    policy = sart.sart(case.n, m=case.m, alpha=0.0, beta=case.beta, interval=case.interval)
    for result in replay(case.trace, policy, case.batch_size):
        assert result.ok
        for o in result.branches:
            assert not (o.status is S.PRUNED and o.ended_in is EXPLORE), (result.request_id, o)
            if o.status is S.PRUNED:  # pruned in phase 2: some branch had completed
                assert result.num_completed >= 1


@settings(max_examples=examples(200))
@given(cases())
def test_first_n_without_pruning_has_self_consistencys_latency(case: Case) -> None:
    first_n = replay(
        case.trace,
        sart.sart_without_pruning(case.n, m=case.n, interval=case.interval),
        case.batch_size,
    )
    sc = replay(case.trace, sart.self_consistency(case.n, interval=case.interval), case.batch_size)
    assert [times(r) for r in first_n] == [times(r) for r in sc]
    assert [statuses(r) for r in first_n] == [statuses(r) for r in sc]
    assert [tokens(r) for r in first_n] == [tokens(r) for r in sc]
    assert all(set(statuses(r)) == {S.FINISHED} for r in sc)


@settings(max_examples=examples(200))
@given(cases())
def test_sart_never_generates_more_tokens_than_self_consistency(case: Case) -> None:
    # With B >= every branch of every request, no branch ever waits for a slot.
    # The property holds for any B, and it is asserted for the drawn B as well: a
    # branch never generates more than its script's length, and Self-Consistency runs
    # every branch to its end whatever B is, so its tokens are the most any policy
    # with the same n can generate. Queueing does change what SART generates (see
    # test_queueing_changes_what_sart_generates): with a small B, SART may run a long
    # branch to its end before a short one ever starts, but never beyond the script.
    sart_policy = sart.sart(
        case.n, m=case.m, alpha=case.alpha, beta=case.beta, interval=case.interval
    )
    sc_policy = sart.self_consistency(case.n, interval=case.interval)
    for batch_size in (case.total_branches, case.batch_size):
        sc = replay(case.trace, sc_policy, batch_size)
        ours = replay(case.trace, sart_policy, batch_size)
        assert [r.generated_tokens for r in sc] == [full_tokens(r) for r in case.trace]
        for mine, theirs in zip(ours, sc):
            assert mine.ok
            assert mine.generated_tokens <= theirs.generated_tokens, (batch_size, mine.request_id)


@settings(max_examples=examples(40))
@given(cases())
def test_the_runner_replays_a_trace_like_the_driver(case: Case) -> None:
    config = steps_config(case.interval, case.batch_size)
    record = run_method(case.trace, "sart", case.n, config)
    direct = replay(case.trace, sart.sart(case.n, interval=case.interval), case.batch_size)
    assert [signature(r) for r in record.results] == [signature(r) for r in direct]
    assert record.summary.makespan == max(r.timings.finished for r in direct)
    assert record.kv_capacity is None  # the steps model has no capacity
    assert math.isfinite(record.summary.e2e.p99)
