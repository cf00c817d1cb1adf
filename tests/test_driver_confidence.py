"""The driver with a policy's own reward source: confidence from the engine's logprobs."""

from __future__ import annotations

import pytest

import sart
from sart.async_driver import AsyncDriver
from sart.rewards import ConfidenceScorer, LowestGroupConfidence
from sart.testing import BranchScript, FakeEngine, ScriptedPRM
from sart.types import BranchStatus

# Branches 0 and 1 complete first (the warm-up: threshold between their confidences 9 and
# 8.5); branch 2 loses confidence after token 16 and would run longest.
SCRIPTS = [
    BranchScript(length=40, answer="7", confidences=(9.0,), logprob_every=8),
    BranchScript(length=44, answer="7", confidences=(8.5,), logprob_every=8),
    BranchScript(length=80, answer="3", confidences=(9.0, 9.0, 1.0), logprob_every=8),
    BranchScript(length=56, answer="7", confidences=(9.0,), logprob_every=8),
]


def confident() -> sart.Policy:
    return sart.deepconf_online(4, warmup=2, keep=90.0, interval=8, window=8, top_k=3)


def test_deepconf_prunes_the_branch_whose_confidence_drops() -> None:
    engine = FakeEngine({"r": SCRIPTS})
    policy = confident()
    [result] = sart.run([sart.Request("r", "p", policy)], engine)
    statuses = [b.status for b in result.branches]
    assert statuses[2] is BranchStatus.PRUNED
    assert statuses[0] is statuses[1] is statuses[3] is BranchStatus.FINISHED
    assert result.answer == "7"
    # Nothing is pruned before the warm-up completes (44 tokens); branch 2 is pruned at
    # the first check after it, long before its 80 tokens.
    assert 44 <= result.branches[2].num_tokens <= 48
    # The engine was asked for the scorer's top-k; the scorer forgot the request.
    assert policy.reward.requests_held == 0  # type: ignore[union-attr]


def test_without_the_drop_nothing_is_pruned() -> None:
    steady = [*SCRIPTS[:2], BranchScript(length=80, answer="3", confidences=(9.0,)), SCRIPTS[3]]
    [result] = sart.run([sart.Request("r", "p", confident())], FakeEngine({"r": steady}))
    assert BranchStatus.PRUNED not in [b.status for b in result.branches]


class AskedEngine(FakeEngine):
    """Records the sampling each request is prefilled with."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.asked: dict[str, int | None] = {}

    def prefill(self, request_id, prompt, sampling):  # type: ignore[no-untyped-def]
        self.asked[request_id] = sampling.logprobs
        return super().prefill(request_id, prompt, sampling)


def test_the_engine_is_asked_for_the_logprobs_the_source_reads() -> None:
    engine = AskedEngine({"r": SCRIPTS, "s": SCRIPTS})
    requests = [
        sart.Request("r", "p", confident()),
        sart.Request("s", "p", sart.sart(4, interval=8)),
    ]
    sart.run(requests, engine, ScriptedPRM(every=8))
    assert engine.asked == {"r": 3, "s": None}  # the PRM-scored request costs nothing more


def test_a_confidence_request_and_a_prm_request_are_each_scored_by_their_own_source() -> None:
    scripts = {"conf": SCRIPTS, "prm": [BranchScript(length=40, rewards=(0.9,))] * 4}
    prm = ScriptedPRM(scripts, every=8)
    calls: list[set[str]] = []
    score = prm.score

    def spy(items):  # type: ignore[no-untyped-def]
        calls.append({i.branch.request_id for i in items})
        return score(items)

    prm.score = spy  # type: ignore[method-assign]
    results = sart.run(
        [
            sart.Request("conf", "p", confident()),
            sart.Request("prm", "p", sart.sart(4, interval=8)),
        ],
        FakeEngine(scripts),
        prm,
    )
    assert all(r.status is sart.RequestStatus.COMPLETED for r in results)
    assert calls and all(ids == {"prm"} for ids in calls)  # never asked about "conf"
    assert results[0].branches[2].status is BranchStatus.PRUNED


def test_confidence_needs_no_driver_prm() -> None:
    [result] = sart.run([sart.Request("r", "p", confident())], FakeEngine({"r": SCRIPTS}))
    assert result.status is sart.RequestStatus.COMPLETED


def test_an_engine_without_logprobs_fails_only_the_confidence_request() -> None:
    class NoLogprobs(FakeEngine):
        def prefill(self, request_id, prompt, sampling):  # type: ignore[no-untyped-def]
            import attrs

            return super().prefill(request_id, prompt, attrs.evolve(sampling, logprobs=None))

    engine = NoLogprobs({"conf": SCRIPTS, "sc": SCRIPTS})
    results = sart.run(
        [sart.Request("conf", "p", confident()), sart.Request("sc", "p", sart.self_consistency(4))],
        engine,
    )
    assert results[0].status is sart.RequestStatus.FAILED
    assert "log-probabilities" in (results[0].reason or "")
    assert results[1].status is sart.RequestStatus.COMPLETED
    assert engine.stats().live_branches == 0


@pytest.mark.parametrize("scoring", ["blocking", "overlapped"])
def test_the_async_driver_routes_the_same_way(scoring: str) -> None:
    import asyncio

    from sart.engines.fake_streaming import FakeStreamingEngine

    async def main() -> list[sart.RequestResult]:
        engine = FakeStreamingEngine({"r": SCRIPTS})
        driver = AsyncDriver(engine, batch_size=8, scoring=scoring)
        return await driver.run([sart.Request("r", "p", confident())])

    [result] = asyncio.run(main())
    assert result.answer == "7"  # the confidence-weighted vote
    assert all(b.reward is not None for b in result.branches if b.status.is_completed)
    if scoring == "blocking":  # overlapped, on the wall clock, it may end before a check
        assert result.branches[2].status is BranchStatus.PRUNED


def test_signal_state_never_holds_a_finished_request() -> None:
    scorer = ConfidenceScorer(LowestGroupConfidence(window=8), top_k=3)
    policy = sart.Policy(
        n=4,
        prune=sart.WarmupThreshold(warmup=1),
        select=sart.WeightedVote(),
        interval=8,
        reward=scorer,
    )
    requests = [sart.Request(f"r{i}", "p", policy) for i in range(5)]
    sart.run(requests, FakeEngine({f"r{i}": SCRIPTS for i in range(5)}), batch_size=6)
    assert scorer.requests_held == 0
