"""Property tests: whole workloads run through ``SyncDriver`` on the fake engine.

Each example draws a workload (``strategies.workloads``), runs it to the end
and checks what Algorithm 1 promises: every request ends exactly once, the
batch budget ``B`` is never exceeded, resources are freed before a result is
delivered, admission is FCFS, pruning respects ``beta`` and never takes every
branch, the stop rule and the selector are honoured, only requests hit by an
injected fault fail, and a rerun gives identical results. A second group of
properties checks end-to-end latency of a request served alone against the
order statistics of its branch lengths (``step_cost=1``: time is in steps).
"""

from __future__ import annotations

import math
from collections import Counter

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import sart
from sart import BranchStatus, Phase, RequestResult, RequestStatus
from sart.confidence.scorer import ConfidenceScorer
from sart.confidence.signals import NEUTRAL_REWARD
from sart.testing import BranchScript, FakeEngine, ScriptedPRM
from strategies import (
    PREFILL,
    PRM_FAIL,
    START,
    Workload,
    arrivals,
    branch_end,
    branch_scripts,
    branch_text,
    examples,
    intervals,
    rewards,
    workloads,
)

ENDED_EARLY = {BranchStatus.PRUNED, BranchStatus.STOPPED, BranchStatus.FAILED}


# ---------------------------------------------------------------- running a workload


@attrs.define
class Outcome:
    """A finished run: the engine and PRM it used, the driver, and its results."""

    engine: FakeEngine
    prm: ScriptedPRM
    driver: sart.SyncDriver
    results: list[RequestResult]
    delivered: list[str]


def run_workload(workload: Workload) -> Outcome:
    """Run ``workload`` on a fresh engine and PRM, checking resources at each delivery."""
    engine, prm = workload.engine(), workload.scripted_prm()
    delivered: list[str] = []

    def on_result(result: RequestResult) -> None:
        rid = result.request_id
        assert rid not in delivered, f"{rid} delivered twice"
        still_live = sorted(b for b in engine.live_branches if b.request_id == rid)
        assert not still_live, f"{rid} delivered while {still_live} are live"
        assert rid not in engine.prefixes, f"{rid} delivered while its prefix is held"
        delivered.append(rid)

    driver = sart.SyncDriver(
        engine,
        workload.prm(prm),
        batch_size=workload.batch_size,
        admission=workload.admission,
        scoring=workload.scoring,
        on_result=on_result,
    )
    results = driver.run(workload.requests)
    return Outcome(engine, prm, driver, results, delivered)


# ---------------------------------------------------------------- checks


def expected_reward(
    workload: Workload, request: sart.Request, index: int, tokens: int, final: bool
) -> float:
    """What branch ``index`` should have been rewarded after ``tokens`` tokens: its
    script's PRM reward, or, for a policy with its own confidence source, that signal
    recomputed from scratch over the script's first ``tokens`` log-probabilities."""
    script = workload.scripts[request.id][index]
    source = request.policy.reward
    if source is None:
        return script.reward_at(tokens, workload.prm_every, final)
    assert isinstance(source, ConfidenceScorer)
    if tokens == 0:
        return NEUTRAL_REWARD
    state = source.signal.track()
    for token in script.logprobs_span(0, tokens, source.logprobs_wanted):
        state.push(token)
    return source.signal.reward(state.value(), source.scale)


def check_accounting(workload: Workload, out: Outcome) -> None:
    """Every request ends exactly once; the run leaves nothing behind."""
    ids = [r.id for r in workload.requests]
    assert [r.request_id for r in out.results] == ids
    assert sorted(out.delivered) == sorted(ids)
    assert len(out.driver.results) == len(ids)
    assert out.engine.live_branches == frozenset()
    assert out.engine.prefixes == frozenset()
    assert out.engine.stats().kv_tokens == 0
    stats = out.driver.scheduler.statistics()
    assert out.driver.scheduler.idle
    assert (stats.running_branches, stats.queued_branches, stats.queued_requests) == (0, 0, 0)
    assert (stats.active_requests, stats.failed_cleanups) == (0, 0)
    assert stats.finished_requests == len(ids)
    # The PRM is told about every request whose prefix was held, once; a request whose
    # policy brings its own reward source (confidence) is scored and released by it alone.
    own = {r.id: r.policy.reward for r in workload.requests if r.policy.reward is not None}
    prefilled = [rid for rid in ids if rid not in workload.ids_with(PREFILL)]
    assert Counter(out.prm.released) == Counter(rid for rid in prefilled if rid not in own)
    assert all(source.requests_held == 0 for source in own.values())
    if not workload.ids_with(PRM_FAIL):  # a failing PRM call scores nothing, and is retried
        on_prm = [r for r in out.results if r.request_id not in own]
        assert sum(r.prm_items for r in on_prm) == out.prm.items_scored


def check_budget(workload: Workload, out: Outcome) -> None:
    """At most ``B`` branches at once (the engine also raises ``EngineMisuse`` otherwise)."""
    assert out.engine.peak_live <= workload.batch_size
    assert all(s.running_branches <= workload.batch_size for s in out.driver.timeline)


def check_fcfs(workload: Workload, out: Outcome) -> None:
    """Requests are prefilled once each, in (arrival, submission) order."""
    order = sorted(range(len(workload.requests)), key=lambda i: (workload.requests[i].arrival, i))
    prefills = [entry[1] for entry in out.engine.log if entry[0] == "prefill"]
    assert prefills == [workload.requests[i].id for i in order]


def check_timings(request: sart.Request, result: RequestResult) -> None:
    t = result.timings
    assert t.arrival == request.arrival
    assert t.scheduled is not None
    assert t.scheduled >= t.arrival
    assert t.finished >= t.scheduled
    assert t.queueing >= 0
    assert t.inference >= 0


def check_branches(workload: Workload, request: sart.Request, result: RequestResult) -> None:
    """Each outcome agrees with its branch's script: tokens, status, text-derived answer."""
    assert [b.index for b in result.branches] == list(range(request.policy.n))
    for b, script in zip(result.branches, workload.scripts[request.id]):
        end = branch_end(script, request.sampling)
        if b.status.is_completed:
            truncated = script.length > request.sampling.max_tokens
            assert b.status is (BranchStatus.TRUNCATED if truncated else BranchStatus.FINISHED)
            assert b.num_tokens == end
            assert b.ended_in is not None
        else:
            assert b.status in ENDED_EARLY
            assert b.num_tokens < end
            assert b.answer is None
        if b.num_tokens > 0:
            assert b.ended_in is not None


def check_pruning(workload: Workload, request: sart.Request, result: RequestResult) -> None:
    """Never all ``n`` pruned; phase 1 prunes at most ``beta``, each below ``alpha``."""
    policy = request.policy
    pruned = [b for b in result.branches if b.status is BranchStatus.PRUNED]
    assert len(pruned) <= policy.n - 1
    if isinstance(policy.prune, sart.ShedUnderLoad):
        # Shedding may prune past beta, and above alpha; never all, never unscored
        # ones before scored ones (checked in the rule's own tests).
        return
    for b in pruned:
        # Pruned on the reward of the check that pruned it: taken at its current length
        # when checks block; overlapped, at its length when the check's snapshot was taken.
        scored_at, reward = b.reward_history[-1]
        assert b.reward == reward
        assert b.reward == expected_reward(workload, request, b.index, scored_at, False)
        assert scored_at <= b.num_tokens
        if not workload.delays_rewards:
            assert scored_at == b.num_tokens
    if isinstance(policy.prune, sart.WarmupThreshold):
        # Pruned only once the warm-up completed, below a percentile of its rewards.
        done = [b.reward for b in result.branches if b.status.is_completed]
        assert not pruned or len(done) >= policy.prune.warmup
        assert all(b.reward is not None and b.reward < max(done) for b in pruned)
        return
    if not isinstance(policy.prune, sart.TwoPhasePrune):
        assert pruned == []
        return
    explore = [b for b in pruned if b.ended_in is Phase.EXPLORE]
    assert len(explore) <= policy.prune.beta
    for b in explore:
        assert b.reward is not None
        assert b.reward < policy.prune.alpha


def check_reward_history(workload: Workload, request: sart.Request, result: RequestResult) -> None:
    """Every reward a branch received is its own script's, at the length it was scored
    at, in order: rewards that arrive late never land on another branch, and a
    completed branch's last reward is its final one."""
    for b in result.branches:
        lengths = [tokens for tokens, _ in b.reward_history]
        assert lengths == sorted(lengths)
        assert all(tokens <= b.num_tokens for tokens in lengths)
        for k, (tokens, reward) in enumerate(b.reward_history):
            final = b.status.is_completed and tokens == b.num_tokens
            assert k == len(lengths) - 1 or not final
            assert reward == expected_reward(workload, request, b.index, tokens, final)


def check_completed(workload: Workload, request: sart.Request, result: RequestResult) -> None:
    scripts = workload.scripts[request.id]
    assert result.reason is None
    assert result.num_completed >= 1
    assert not any(b.status is BranchStatus.FAILED for b in result.branches)
    assert result.chosen is not None
    chosen = result.branches[result.chosen]
    assert chosen.status.is_completed
    text = branch_text(scripts[result.chosen], request.sampling)
    assert result.text == text
    # One log-probability per token of the chosen branch, where the request keeps them.
    kept = result.logprobs
    assert (kept is not None) == request.keep_logprobs
    assert kept is None or len(kept) == chosen.num_tokens
    assert result.answer == sart.extract_answer(text) == chosen.answer
    for b in result.branches:
        if b.status.is_completed:
            assert b.answer == sart.extract_answer(branch_text(scripts[b.index], request.sampling))
    check_stop_rule(request, result)
    check_rewards(workload, request, result)
    check_selection(request, result)


def check_stop_rule(request: sart.Request, result: RequestResult) -> None:
    """A request stops once ``m`` branches complete (or ``k`` finished ones agree), or
    when no branch is left."""
    policy = request.policy
    left = policy.n - result.num_pruned  # branches that could complete
    if isinstance(policy.stop, sart.FirstM):
        assert result.num_completed >= min(policy.stop.m, left)
    elif isinstance(policy.stop, sart.Agreement):
        finished = Counter(
            b.answer for b in result.branches if b.status is BranchStatus.FINISHED and b.answer
        )
        agreed = max(finished.values(), default=0) >= policy.stop.k
        assert agreed or result.num_completed >= min(policy.stop.m, left)
    else:
        assert result.num_completed == left
        assert not any(b.status is BranchStatus.STOPPED for b in result.branches)


def check_rewards(workload: Workload, request: sart.Request, result: RequestResult) -> None:
    """Completed branches carry their scripted final reward when the policy scores them."""
    policy = request.policy
    if policy.scores_completed:
        assert result.prm_items >= result.num_completed
    for b in result.branches:
        if policy.scores_completed and b.status.is_completed:
            expected = expected_reward(workload, request, b.index, b.num_tokens, True)
            assert b.reward == expected
        if not (policy.scores_completed or policy.scores_running):
            assert b.reward is None
    if isinstance(policy.prune, sart.TwoPhasePrune):
        # Phase 2 prunes below the first completion's reward; that completion ended in phase 1.
        firsts = [
            b.reward
            for b in result.branches
            if b.status.is_completed and b.ended_in is Phase.EXPLORE
        ]
        assert firsts, "the first completion ended in the explore phase"
        for b in result.branches:
            if b.status is BranchStatus.PRUNED and b.ended_in is Phase.EXPLOIT:
                assert b.reward < max(firsts)


def check_selection(request: sart.Request, result: RequestResult) -> None:
    """The chosen branch is what the policy's selector promises, among the branches that
    finished if any did (a branch cut at max_tokens answers only when all were)."""
    select = request.policy.select
    completed = [b for b in result.branches if b.status.is_completed]
    done = [b for b in completed if b.status is BranchStatus.FINISHED] or completed
    chosen = result.branches[result.chosen]
    assert chosen in done
    if len(done) == 1:
        assert chosen is done[0]
        return
    groups: dict[str, list[sart.BranchOutcome]] = {}
    for b in done:
        groups.setdefault(b.answer, []).append(b)
    if isinstance(select, sart.BestReward):
        assert chosen.reward == max(b.reward for b in done)
    elif isinstance(select, sart.MajorityVote):
        assert len(groups[chosen.answer]) == max(len(g) for g in groups.values())
    elif isinstance(select, sart.WeightedVote):
        weight = {a: math.fsum(b.reward for b in g) for a, g in groups.items()}
        assert weight[chosen.answer] >= max(weight.values()) - 1e-9
        assert chosen.reward == max(b.reward for b in groups[chosen.answer])


def check_failed(workload: Workload, request: sart.Request, result: RequestResult) -> None:
    assert request.id in workload.faulted, f"{request.id} failed with no fault injected"
    assert isinstance(result.reason, str)
    assert result.reason
    assert (result.chosen, result.text, result.answer) == (None, None, None)
    for b in result.branches:
        assert b.status is not BranchStatus.STOPPED
        assert b.answer is None
    if request.id in workload.ids_with(PREFILL):
        assert result.reason.startswith("prefill failed")
        assert all(b.num_tokens == 0 and b.ended_in is None for b in result.branches)


def check_result(workload: Workload, request: sart.Request, result: RequestResult) -> None:
    assert result.request_id == request.id
    assert result.policy == request.policy.name
    if not (request.policy.scores_completed or request.policy.scores_running):
        assert result.prm_items == 0
    check_timings(request, result)
    check_branches(workload, request, result)
    check_pruning(workload, request, result)
    check_reward_history(workload, request, result)
    if request.id not in workload.faulted:
        assert result.status is RequestStatus.COMPLETED, result.reason
    if request.id in workload.ids_with(PREFILL) | workload.ids_with(START):
        assert result.status is RequestStatus.FAILED
    if result.status is RequestStatus.COMPLETED:
        check_completed(workload, request, result)
    else:
        check_failed(workload, request, result)


def record_events(workload: Workload, out: Outcome) -> None:
    """Coverage of the interesting cases, shown by ``--hypothesis-show-statistics``."""
    outcomes = [b for r in out.results for b in r.branches]
    for status in sorted({b.status for b in outcomes}):
        event(f"branch {status.name}")
    if any(b.status is BranchStatus.PRUNED and b.ended_in is Phase.EXPLOIT for b in outcomes):
        event("pruned in exploit")
    if any(not r.ok for r in out.results):
        event("request failed")
    if out.engine.peak_live == workload.batch_size:
        event("batch full")


def check_workload(workload: Workload) -> None:
    out = run_workload(workload)
    record_events(workload, out)
    check_accounting(workload, out)
    check_budget(workload, out)
    check_fcfs(workload, out)
    for request, result in zip(workload.requests, out.results):
        check_result(workload, served(request, result), result)
    again = run_workload(workload)
    assert again.results == out.results
    assert again.engine.log == out.engine.log
    other = {sart.Scoring.BLOCKING: sart.Scoring.OVERLAPPED}.get(
        workload.scoring, sart.Scoring.BLOCKING
    )
    if any(cost > 0 for cost in workload.prm_costs):
        event("PRM calls take time")
        return
    # With a free PRM, overlapped checks serve every request as Algorithm 1 does; only
    # the order of checks within a step differs (those needing no rewards go first).
    twin = run_workload(attrs.evolve(workload, scoring=other))
    assert twin.results == out.results
    assert Counter(twin.engine.log) == Counter(out.engine.log)
    assert twin.engine.steps == out.engine.steps


def served(request: sart.Request, result: RequestResult) -> sart.Request:
    """``request`` with the policy it was served with: an admission rule's choice (its
    ``build`` for the number of branches the result has), else its own."""
    rule = request.policy.admit
    if not isinstance(rule, sart.BranchByLoad) or rule.build is None:
        return request
    n = len(result.branches)
    assert min(rule.floor, rule.prm_floor) <= n <= request.policy.n
    return attrs.evolve(request, policy=attrs.evolve(rule.build(n), name=request.policy.name))


# ---------------------------------------------------------------- properties


@settings(max_examples=examples(2000))
@given(workload=workloads())
def test_workload_properties(workload: Workload) -> None:
    check_workload(workload)


@pytest.mark.slow
@settings(max_examples=examples(100))
@given(workload=workloads(max_requests=24))
def test_workload_properties_large(workload: Workload) -> None:
    check_workload(workload)


def run_alone(
    policy: sart.Policy,
    scripts: list[BranchScript],
    sampling: sart.SamplingSettings,
    arrival: float,
    batch_size: int,
    admission: sart.Admission,
) -> Outcome:
    """Serve one request alone, with no faults."""
    request = sart.Request("solo", "p", policy, sampling, arrival)
    workload = Workload(
        requests=(request,),
        scripts={"solo": tuple(scripts)},
        faults={"solo": ()},
        batch_size=batch_size,
        admission=admission,
        prm_every=policy.interval,
        attribute_failures=False,
    )
    return run_workload(workload)


@settings(max_examples=examples(300))
@given(
    script=branch_scripts,
    max_tokens=st.integers(1, 80),
    interval=intervals,
    arrival=arrivals,
    admission=st.sampled_from(sart.Admission),
    batch_size=st.integers(1, 16),
)
def test_vanilla_latency_is_branch_length(
    script: BranchScript,
    max_tokens: int,
    interval: int,
    arrival: float,
    admission: sart.Admission,
    batch_size: int,
) -> None:
    """Hand check: alone, one step per token, Vanilla takes exactly its branch length."""
    sampling = sart.SamplingSettings(max_tokens=max_tokens)
    out = run_alone(
        sart.vanilla(interval),
        [script],
        sampling,
        arrival=arrival,
        batch_size=batch_size,
        admission=admission,
    )
    (result,) = out.results
    length = script.length if script.length <= max_tokens else max_tokens
    assert result.timings.queueing == 0
    assert result.timings.end_to_end == pytest.approx(length, abs=1e-9)
    assert result.timings.inference == pytest.approx(length, abs=1e-9)
    assert out.engine.steps == length


@st.composite
def solo_policies(draw: st.DrawFn) -> sart.Policy:
    """Policies without pruning: their latency alone depends on branch lengths only."""
    n = draw(st.integers(1, 8))
    interval = draw(intervals)
    kind = draw(st.sampled_from(("vanilla", "self_consistency", "sart_without_pruning")))
    if kind == "vanilla":
        return sart.vanilla(interval)
    if kind == "self_consistency":
        return sart.self_consistency(n, interval)
    return sart.sart_without_pruning(n, draw(st.integers(1, n)), interval)


@settings(max_examples=examples(300))
@given(
    policy=solo_policies(),
    data=st.data(),
    max_tokens=st.integers(1, 80),
    arrival=arrivals,
    admission=st.sampled_from(sart.Admission),
)
def test_latency_alone_is_mth_shortest_branch(
    policy: sart.Policy,
    data: st.DataObject,
    max_tokens: int,
    arrival: float,
    admission: sart.Admission,
) -> None:
    """With all ``n`` branches in the batch, a request ends with its ``m``-th completion.

    ``TOKEN`` admission notices that completion at once; ``CHUNK`` admission at
    the end of the chunk of ``T`` steps it falls in, unless every branch has
    ended before then (the engine returns early).
    """
    scripts = data.draw(st.lists(branch_scripts, min_size=policy.n, max_size=policy.n))
    batch_size = data.draw(st.integers(policy.n, 16))
    sampling = sart.SamplingSettings(max_tokens=max_tokens)
    out = run_alone(
        policy, scripts, sampling, arrival=arrival, batch_size=batch_size, admission=admission
    )
    (result,) = out.results
    m = policy.stop.m if isinstance(policy.stop, sart.FirstM) else policy.n
    ends = sorted(branch_end(s, sampling) for s in scripts)
    mth, last, t = ends[m - 1], ends[-1], policy.interval
    expected = mth if admission is sart.Admission.TOKEN else min(math.ceil(mth / t) * t, last)
    assert result.ok
    assert result.timings.end_to_end == pytest.approx(expected, abs=1e-9)
    assert result.num_completed == sum(1 for e in ends if e <= expected)


@settings(max_examples=examples(300))
@given(
    n=st.integers(2, 8),
    data=st.data(),
    max_tokens=st.integers(1, 80),
    interval=intervals,
    admission=st.sampled_from(sart.Admission),
)
def test_pruning_alone_is_below_thresholds(
    n: int, data: st.DataObject, max_tokens: int, interval: int, admission: sart.Admission
) -> None:
    """Alone, every branch starts at step 0, so the first completion is known from the
    scripts: the shortest completed branch (lowest index on ties). Phase 2 prunes only
    branches rewarded below that branch's final reward, phase 1 only below ``alpha``."""
    alpha = data.draw(rewards)
    beta = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.sampled_from([sart.AllDone(), sart.FirstM(data.draw(st.integers(1, n)))]))
    policy = sart.Policy(n=n, stop=stop, prune=sart.TwoPhasePrune(alpha, beta), interval=interval)
    scripts = data.draw(st.lists(branch_scripts, min_size=n, max_size=n))
    sampling = sart.SamplingSettings(max_tokens=max_tokens)
    batch_size = data.draw(st.integers(n, 16))
    out = run_alone(policy, scripts, sampling, 0, batch_size, admission)
    (result,) = out.results
    assert result.ok
    done = [b for b in result.branches if b.status.is_completed]
    first = min(done, key=lambda b: (branch_end(scripts[b.index], sampling), b.index))
    assert first.ended_in is Phase.EXPLORE
    threshold = scripts[first.index].reward_at(first.num_tokens, interval, True)
    for b in result.branches:
        if b.status is BranchStatus.PRUNED:
            event(f"pruned in {b.ended_in.value}")
            limit = alpha if b.ended_in is Phase.EXPLORE else threshold
            assert b.reward < limit
