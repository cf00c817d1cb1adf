"""Failure semantics of the synchronous driver: a fault fails only the requests it hits."""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs
import pytest

import sart
from sart.engines.base import BranchSpec, StepOutput
from sart.testing import BranchScript, EngineMisuse, FakeEngine, ScriptedPRM
from sart.types import BranchId, BranchStatus


def scenario(n_requests: int = 3, n: int = 2, length: int = 30) -> dict:
    return {
        f"r{i}": [BranchScript(length=length + j, answer="1") for j in range(n)]
        for i in range(n_requests)
    }


def requests(script: dict, policy: sart.Policy) -> list[sart.Request]:
    return [sart.Request(rid, "p", policy) for rid in script]


def assert_clean(engine: FakeEngine) -> None:
    assert not engine.live_branches
    assert not engine.prefixes


def test_prefill_failure_fails_one_request() -> None:
    script = scenario()
    engine = FakeEngine(script, fail_prefill={"r1"})
    results = sart.run(requests(script, sart.self_consistency(2)), engine, batch_size=8)
    assert [r.ok for r in results] == [True, False, True]
    assert "injected prefill failure" in (results[1].reason or "")
    assert_clean(engine)


def test_start_failure_releases_the_prefix() -> None:
    script = scenario()
    engine = FakeEngine(script, fail_start={"r0"})
    results = sart.run(requests(script, sart.self_consistency(2)), engine, batch_size=8)
    assert [r.ok for r in results] == [False, True, True]
    assert ("release", "r0") in engine.log
    assert_clean(engine)


def test_decode_failure_aborts_that_request_and_the_rest_carry_on() -> None:
    script = scenario()
    engine = FakeEngine(script, fail_step={BranchId("r2", 1): 12})
    prm = ScriptedPRM(script, every=10)
    results = sart.run(requests(script, sart.sart(2, interval=10)), engine, prm, batch_size=8)
    assert [r.ok for r in results] == [True, True, False]
    failed = results[2]
    assert "decode failed" in (failed.reason or "")
    assert [b.status for b in failed.branches] == [BranchStatus.FAILED] * 2
    assert [b.num_tokens for b in failed.branches] == [10, 10]  # the failing chunk ran nowhere
    assert ("abort", (BranchId("r2", 0), BranchId("r2", 1))) in engine.log
    assert prm.released.count("r2") == 1
    assert_clean(engine)


class RefusesMidStream(FakeEngine):
    """A gateway's engine whose upstream refuses request "r1" (HTTP 400) when it starts
    decoding, or when its branches start."""

    def __init__(self, script: dict, at: str) -> None:
        super().__init__(script)
        self.at = at

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        if self.at == "start" and request_id == "r1":
            raise sart.RequestRefused("the server refused it (HTTP 400)", [request_id])
        super().start_branches(request_id, branches)

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        if self.at == "decode" and BranchId("r1", 0) in self.live_branches:
            raise sart.RequestRefused("the server refused it (HTTP 400)", ["r1"])
        return super().step(max_steps, until_first_end)


@pytest.mark.parametrize("at", ["start", "decode"])
def test_a_refusal_after_prefill_is_a_refusal(at: str) -> None:
    # Before, only a prefill's RequestRefused marked the request refused (a server
    # answers it 400); a gateway's upstream says no when the branches stream.
    script = scenario()
    engine = RefusesMidStream(script, at)
    results = sart.run(requests(script, sart.self_consistency(2)), engine, batch_size=8)
    assert [(r.ok, r.refused) for r in results] == [(True, False), (False, True), (True, False)]
    assert "the server refused it (HTTP 400)" in (results[1].reason or "")
    assert_clean(engine)


class UnattributedFault:
    """Wraps a FakeEngine; its n-th step raises an error that names no request."""

    def __init__(self, engine: FakeEngine, fail_at_call: int) -> None:
        self.inner = engine
        self.clock = engine.clock
        self.calls = 0
        self.fail_at_call = fail_at_call

    def prefill(self, request_id: str, prompt: object, sampling: sart.SamplingSettings) -> int:
        return self.inner.prefill(request_id, prompt, sampling)  # type: ignore[arg-type]

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        self.inner.start_branches(request_id, branches)

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise RuntimeError("CUDA error: device-side assert")
        return self.inner.step(max_steps, until_first_end)

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        self.inner.abort(branch_ids)

    def release_prefix(self, request_id: str) -> None:
        self.inner.release_prefix(request_id)

    def stats(self) -> sart.EngineStats:
        return self.inner.stats()


def test_unattributed_decode_failure_fails_the_batch_and_later_requests_run() -> None:
    script = scenario(n_requests=3, n=2)
    engine = FakeEngine(script)
    wrapped = UnattributedFault(engine, fail_at_call=1)
    # B=4 holds r0 and r1; r2 is still queued when the first decode fails.
    results = sart.run(requests(script, sart.self_consistency(2)), wrapped, batch_size=4)
    assert [r.ok for r in results] == [False, False, True]
    assert "CUDA error" in (results[0].reason or "")
    assert_clean(engine)


@pytest.mark.parametrize("attribute", [True, False])
def test_prm_failure_fails_only_the_request_at_fault(attribute: bool) -> None:
    script = scenario(n_requests=3, n=3)
    prm = ScriptedPRM(script, every=10, fail_on={BranchId("r1", 2)}, attribute_failures=attribute)
    engine = FakeEngine(script)
    results = sart.run(requests(script, sart.sart(3, interval=10)), engine, prm, batch_size=16)
    assert [r.ok for r in results] == [True, False, True]
    assert "PRM failed" in (results[1].reason or "")
    assert "injected PRM failure" in (results[1].reason or "")
    assert_clean(engine)


def test_prm_returning_too_few_rewards_is_isolated() -> None:
    class ShortPRM:
        def score(self, items: Sequence[sart.ScoreItem]) -> list[float]:
            values = [0.7] * len(items)
            return values[:-1] if any(i.branch.request_id == "r0" for i in items) else values

    script = scenario(n_requests=2, n=2)
    engine = FakeEngine(script)
    results = sart.run(requests(script, sart.sart(2, interval=10)), engine, ShortPRM())
    assert [r.ok for r in results] == [False, True]
    assert "1 rewards for 2 items" in (results[0].reason or "")
    assert_clean(engine)


def test_reward_out_of_range_fails_the_request() -> None:
    script = scenario(n_requests=2, n=2)
    prm = ScriptedPRM(script, every=10, nan_for={BranchId("r0", 0)})
    engine = FakeEngine(script)
    results = sart.run(requests(script, sart.sart(2, interval=10)), engine, prm)
    assert [r.ok for r in results] == [False, True]
    assert "rewards must be in [0, 1]" in (results[0].reason or "")
    assert_clean(engine)


def test_policy_hook_error_fails_only_its_request() -> None:
    class Broken(sart.PruneRule):
        def choose(self, request: sart.RequestView) -> list[int]:
            raise KeyError("oops")

    script = scenario(n_requests=2, n=2)
    engine = FakeEngine(script)
    prm = ScriptedPRM(script, every=10)
    bad = sart.Policy(n=2, prune=Broken(), interval=10)
    reqs = [sart.Request("r0", "p", bad), sart.Request("r1", "p", sart.sart(2, interval=10))]
    results = sart.run(reqs, engine, prm)
    assert [r.ok for r in results] == [False, True]
    assert "Broken.choose raised KeyError" in (results[0].reason or "")
    assert_clean(engine)


def test_prune_rule_choosing_a_branch_that_is_not_running_is_reported() -> None:
    class PrunesGhosts(sart.PruneRule):
        needs_rewards = False

        def choose(self, request: sart.RequestView) -> list[int]:
            return [7]

    script = scenario(n_requests=1, n=2)
    (result,) = sart.run(
        [
            sart.Request(
                "r0",
                "p",
                sart.Policy(n=2, prune=PrunesGhosts(), select=sart.MajorityVote(), interval=10),
            )
        ],
        FakeEngine(script),
    )
    assert not result.ok
    assert "chose 7, not a branch index" in (result.reason or "")


def test_engine_misuse_is_not_swallowed() -> None:
    class DoubleAbort(FakeEngine):
        def abort(self, branch_ids: Sequence[BranchId]) -> None:
            super().abort(branch_ids)
            super().abort(branch_ids)

    script = {"r0": [BranchScript(length=5), BranchScript(length=50)]}
    with pytest.raises(EngineMisuse, match="not live"):
        sart.run(
            [sart.Request("r0", "p", sart.sart_without_pruning(2, m=1, interval=10))],
            DoubleAbort(script),
            ScriptedPRM(script),
        )


def test_arrivals_are_released_on_the_virtual_clock() -> None:
    script = {"a": [BranchScript(length=4)], "b": [BranchScript(length=4)]}
    reqs = [
        sart.Request("a", "p", sart.vanilla()),
        sart.Request("b", "p", sart.vanilla(), arrival=100.0),
    ]
    driver = sart.SyncDriver(FakeEngine(script), batch_size=4)
    results = driver.run(reqs)
    assert results[1].timings.scheduled == 100.0
    assert results[1].timings.finished == 104.0
    assert results[1].timings.queueing == 0.0
    assert [s.running_branches for s in driver.timeline] == [0, 0]
    assert [s.time for s in driver.timeline] == [4.0, 104.0]


def test_results_come_back_in_submission_order_and_on_result_fires() -> None:
    script = {"long": [BranchScript(length=40)], "short": [BranchScript(length=4)]}
    seen: list[str] = []
    driver = sart.SyncDriver(
        FakeEngine(script), batch_size=4, on_result=lambda r: seen.append(r.request_id)
    )
    results = driver.run([sart.Request(r, "p", sart.vanilla(interval=5)) for r in script])
    assert [r.request_id for r in results] == ["long", "short"]
    assert seen == ["short", "long"]


def test_timeline_tracks_running_branches_and_kv() -> None:
    script = {"a": [BranchScript(length=10), BranchScript(length=20)]}
    driver = sart.SyncDriver(FakeEngine(script), batch_size=4)
    driver.run([sart.Request("a", "one two three", sart.self_consistency(2, interval=5))])
    # Samples after each 5-step chunk: both run until 10, then one, until 20.
    assert [s.running_branches for s in driver.timeline] == [2, 1, 1, 0]
    # KV = 3 prompt tokens + tokens of live branches: 5+5; branch 0 ended at 10 and
    # freed its 10, so 10; then 15; then nothing but the prefix until it is released.
    assert [s.kv_tokens for s in driver.timeline] == [3 + 10, 3 + 10, 3 + 15, 3]


def test_a_start_hook_that_raises_fails_its_request_before_the_engine_is_touched() -> None:
    class BadStart(sart.PruneRule):
        def start(self, n: int) -> sart.Limits:
            raise RuntimeError("boom")

    script = scenario(n_requests=2, n=2)
    engine = FakeEngine(script)
    bad = sart.Policy(n=2, prune=BadStart(), select=sart.MajorityVote())
    reqs = [sart.Request("r0", "p", bad), sart.Request("r1", "p", sart.self_consistency(2))]
    results = sart.run(reqs, engine, batch_size=2)
    assert [r.ok for r in results] == [False, True]
    assert "BadStart.start raised RuntimeError('boom')" in (results[0].reason or "")
    assert ("prefill", "r0") not in engine.log
    assert_clean(engine)


@pytest.mark.parametrize(
    "value",
    [
        None,
        sart.Limits(threshold="high", max_num_pruned=1),
        sart.Limits(threshold=0.5, max_num_pruned=-1),
    ],
)
def test_unusable_limits_fail_only_their_request(value: object) -> None:
    class BadLimits(sart.TwoPhasePrune):
        def start(self, n: int) -> sart.Limits:
            return value  # type: ignore[return-value]

    script = scenario(n_requests=2, n=2)
    bad = sart.Policy(n=2, prune=BadLimits(alpha=0.5, beta=1), interval=2)
    reqs = [sart.Request("r0", "p", bad), sart.Request("r1", "p", sart.sart(2, interval=2))]
    engine = FakeEngine(script)
    results = sart.run(reqs, engine, ScriptedPRM(script, every=2))
    assert [r.ok for r in results] == [False, True]
    assert "start returned" in (results[0].reason or "")
    assert_clean(engine)


def test_extract_returning_a_non_string_fails_the_request() -> None:
    script = scenario(n_requests=1, n=2)
    policy = sart.Policy(n=2, select=sart.MajorityVote(), extract=lambda text: 42)
    (result,) = sart.run([sart.Request("r0", "p", policy)], FakeEngine(script))
    assert not result.ok
    assert "answers must be str" in (result.reason or "")


def test_check_servable_names_the_request_the_policy_and_what_is_missing() -> None:
    from sart.driver import check_servable

    class NoFork(FakeEngine):
        supports_fork = False

    sart_request = sart.Request("q", "p", sart.sart(4))
    with pytest.raises(sart.ConfigError) as no_prm:
        check_servable(sart_request, None, FakeEngine(), no_prm="start it with --prm")
    message = str(no_prm.value)
    assert f"{sart_request.policy.name!r}" in message and "'q'" in message
    assert message.endswith(
        "needs PRM rewards (its prune rule TwoPhasePrune, its selector BestReward read them); "
        "start it with --prm"
    )
    with pytest.raises(sart.ConfigError, match="forks branches; NoFork does not support forking"):
        check_servable(sart.Request("r", "p", sart.rebase(2)), ScriptedPRM(), NoFork())
    check_servable(sart.Request("v", "p", sart.vanilla()), None, NoFork())  # needs neither
    # The asyncio driver refuses the same way, at submit.
    with pytest.raises(sart.ConfigError, match="the driver has no PRM"):
        sart.AsyncDriver(FakeEngine(), batch_size=4).submit(sart_request)


# ------------------------------------------------------------------ cancel


def test_cancel_aborts_a_running_request_and_the_others_carry_on() -> None:
    script = scenario(n_requests=2, n=2, length=30)
    engine = FakeEngine(script)
    driver = sart.SyncDriver(engine, batch_size=4)
    for request in requests(script, sart.self_consistency(2, interval=5)):
        driver.submit(request)
    while engine.steps < 10:
        driver.step()
    assert {b.request_id for b in engine.live_branches} == {"r0", "r1"}
    assert driver.cancel("r0", "client went away")
    driver.step()  # the next step carries the cancel out, before any decode
    assert {b.request_id for b in engine.live_branches} == {"r1"}
    assert "r0" not in engine.prefixes
    while driver.step():
        pass
    r0, r1 = sorted(driver.results, key=lambda r: r.request_id)
    assert (r0.status, r0.reason, r0.chosen, r0.answer) == (
        sart.RequestStatus.CANCELLED,
        "client went away",
        None,
        None,
    )
    assert [b.status for b in r0.branches] == [BranchStatus.FAILED] * 2
    assert [b.num_tokens for b in r0.branches] == [10, 10]
    assert r0.timings.finished == 10.0
    assert r1.ok and r1.answer == "1"
    assert_clean(engine)


def test_a_cancelled_request_that_waits_never_reaches_the_engine() -> None:
    script = scenario(n_requests=2, n=2, length=8)
    engine = FakeEngine(script)
    driver = sart.SyncDriver(engine, batch_size=2)  # r1 waits for r0's slots
    late = sart.Request("late", "p", sart.vanilla(), arrival=50.0)
    for request in [*requests(script, sart.self_consistency(2)), late]:
        driver.submit(request)
    driver.step()
    assert driver.cancel("r1") and driver.cancel("late")
    driver.run()
    results = {r.request_id: r for r in driver.results}
    assert [e for e in engine.log if "r1" in e or "late" in e] == []
    for rid, finished in (("r1", 0.0), ("late", 50.0)):
        result = results[rid]
        assert (result.status, result.reason) == (sart.RequestStatus.CANCELLED, "cancelled")
        assert result.timings.scheduled is None and result.timings.finished == finished
        assert [b.status for b in result.branches] == [BranchStatus.FAILED] * len(result.branches)
    assert results["r0"].ok
    assert_clean(engine)


def test_cancel_of_a_finished_or_unknown_request_is_false() -> None:
    script = scenario(n_requests=1, n=1, length=4)
    driver = sart.SyncDriver(FakeEngine(script), batch_size=2)
    (result,) = driver.run(requests(script, sart.vanilla()))
    assert result.ok
    assert driver.cancel("r0") is False
    assert driver.cancel("nobody") is False
    assert driver.scheduler.cancel("r0") is False


# ------------------------------------------------------------------ timeouts


def test_a_request_past_its_deadline_is_cancelled_at_the_next_step() -> None:
    script = scenario(n_requests=2, n=2, length=30)
    engine = FakeEngine(script)
    reqs = requests(script, sart.self_consistency(2, interval=5))
    reqs[0] = attrs.evolve(reqs[0], timeout=12.0)
    driver = sart.SyncDriver(engine, batch_size=4)
    r0, r1 = driver.run(reqs)
    # Checked between decode chunks of 5 steps: the first step at or past 12 is 15.
    assert (r0.status, r0.timings.finished) == (sart.RequestStatus.CANCELLED, 15.0)
    assert r0.reason == "timed out: not finished within timeout=12"
    assert [b.num_tokens for b in r0.branches] == [15, 15]
    assert r1.ok and r1.timings.finished == 31.0
    assert_clean(engine)


def test_a_waiting_request_times_out_without_reaching_the_engine() -> None:
    script = scenario(n_requests=2, n=2, length=30)
    engine = FakeEngine(script)
    reqs = requests(script, sart.self_consistency(2, interval=5))
    reqs[1] = attrs.evolve(reqs[1], arrival=2.0, timeout=6.0)
    driver = sart.SyncDriver(engine, batch_size=2)  # r1 waits for r0's slots
    r0, r1 = driver.run(reqs)
    assert r1.status is sart.RequestStatus.CANCELLED
    assert (r1.timings.scheduled, r1.timings.finished) == (None, 10.0)
    assert [e for e in engine.log if "r1" in e] == []
    assert r0.ok


def test_the_driver_wakes_at_a_deadline_while_it_waits_for_the_prm() -> None:
    # Both branches end at 10; their final rewards take 100 more: the driver, with
    # nothing else to do, wakes at the deadline (20) rather than at the rewards.
    script = {"r0": [BranchScript(length=10, answer="1", rewards=(0.9,))] * 2}
    slow = sart.CostedPRM(ScriptedPRM(script), lambda items: 100.0)
    request = sart.Request("r0", "p", sart.sart(2, interval=5), timeout=20.0)
    (result,) = sart.SyncDriver(FakeEngine(script), slow, batch_size=4).run([request])
    assert (result.status, result.timings.finished) == (sart.RequestStatus.CANCELLED, 20.0)
    assert [b.status for b in result.branches] == [BranchStatus.FINISHED] * 2


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_a_timeout_must_be_a_positive_number(timeout: object) -> None:
    with pytest.raises(sart.ConfigError, match=r"timeout=.* must be None or a finite number > 0"):
        sart.Request("r", "p", sart.vanilla(), timeout=timeout)  # type: ignore[arg-type]


def test_an_assert_in_a_prm_fails_only_the_request_it_fires_on() -> None:
    # A research PRM checks shapes with assert: that is the PRM's failure, not a bug of
    # sart's (EngineMisuse alone escapes the driver, above).
    script = scenario(n_requests=2, n=2)

    class ShapeChecked(ScriptedPRM):
        def score(self, items: Sequence[sart.ScoreItem]) -> list[float]:
            assert not any(i.branch.request_id == "r0" for i in items), "logits shape"
            return list(super().score(items))

    engine = FakeEngine(script)
    results = sart.run(
        requests(script, sart.sart(2, interval=4))[:2], engine, ShapeChecked(script, every=4)
    )
    assert [r.ok for r in results] == [False, True]
    assert "AssertionError: logits shape" in (results[0].reason or "")
    assert_clean(engine)


def test_an_assert_in_an_engine_fails_its_requests_not_the_run() -> None:
    script = scenario(n_requests=1, n=2)

    class Asserting(FakeEngine):
        def prefill(self, request_id: str, prompt: object, sampling: object) -> int:
            assert request_id != "r0", "an engine's own check"
            return super().prefill(request_id, prompt, sampling)  # type: ignore[arg-type]

    (result,) = sart.run(requests(script, sart.self_consistency(2)), Asserting(script))
    assert not result.ok and "an engine's own check" in (result.reason or "")


@pytest.mark.parametrize(
    ("engine", "prm", "message"),
    [
        (None, None, "engine=None must be an engine (sart.Engine or an async one): it has no "),
        ("vllm", None, "engine='vllm' must be an engine"),
        (FakeEngine(), 42, "prm=42 must be a PRM (it has score(items)) or None"),
    ],
)
def test_a_driver_refuses_what_is_not_an_engine_or_a_prm(
    engine: object, prm: object, message: str
) -> None:
    with pytest.raises(sart.ConfigError, match=re.escape(message)):
        sart.run([], engine, prm)  # type: ignore[arg-type]


def test_a_reward_given_as_a_string_fails_its_request() -> None:
    script = scenario(n_requests=1, n=2)

    class Stringly(ScriptedPRM):
        def score(self, items: Sequence[sart.ScoreItem]) -> list[float]:
            return ["0.5" for _ in items]  # type: ignore[misc]

    (result,) = sart.run(requests(script, sart.sart(2, interval=4)), FakeEngine(script), Stringly())
    assert not result.ok and "PRM returned '0.5' for branch" in (result.reason or "")
