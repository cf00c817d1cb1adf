"""Stateful test: a ``SyncDriver`` driven one ``step()`` at a time, with faults injected live.

Rules submit requests that have already arrived, step the driver, and inject
faults into requests that are running (a failing ``start_branches``, a decode
failure at a live branch's next token, a raising or NaN-returning PRM).
Invariants, checked after every rule: the engine never holds more than ``B``
branches; every live branch belongs to an unfinished request; a finished
request holds no prefix; the scheduler never counts more running branches
than the engine holds, and when it counts fewer (it has pruned, stopped or
failed branches), the very next step carries out just that cleanup;
results are unique. Requests are also cancelled, at any point of their life
(``SyncDriver.cancel``), or time out (``Request.timeout``). They carry
priorities (strict, or aging), so the fake engine's pause and resume run among
the faults; and overlapped checks keep up to ``K`` (drawn) ``Score`` commands in
flight on a PRM of one or more replicas. Draining (a rule,
and the teardown) runs to the end and checks every request ended exactly once,
only faulted ones failed, only cancelled ones were cancelled, and timed-out
ones no sooner than their deadline. One request in three forks branches
(Rebase, particle filtering, SART with a drawn re-branching rule): a request
never holds more live branches in the engine than its ``n``, and every fork
starts from a branch the engine still runs.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import sart
from sart import BranchId, RequestResult, RequestStatus
from sart.testing import BranchScript, FakeEngine, ScriptedPRM, ScriptTable
from strategies import (
    MAX_BATCH,
    PRM_FAIL,
    PRM_NAN,
    START,
    STEP,
    RequestParts,
    examples,
    intervals,
    request_parts,
)

#: Far more driver steps than any drawn run needs; more means the scheduler livelocked.
MAX_DRAIN_STEPS = 20_000


class LiveTable(ScriptTable):
    """A script table that reads requests' scripts as they are submitted, shared by the
    engine and the PRM so that both see the forks the engine made."""

    def __init__(self, scripts: dict[str, tuple[BranchScript, ...]]) -> None:
        super().__init__({})
        self._table = scripts  # the machine's own dict, filled by submit


class SchedulerMachine(RuleBasedStateMachine):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: dict[str, tuple[BranchScript, ...]] = {}
        self.submitted: list[str] = []
        self.results: list[RequestResult] = []
        self.faulted: set[str] = set()
        self.cancelled: set[str] = set()  # cancel() said they were open
        self.deadlines: dict[str, float] = {}  # of requests with a timeout
        self.started_at: dict[BranchId, int] = {}  # engine.steps when a branch went live
        self.widths: dict[str, int] = {}  # each request's n
        self.ready = False

    # ------------------------------------------------------------ helpers

    def _deliver(self, result: RequestResult) -> None:
        rid = result.request_id
        assert not [b for b in self.engine.live_branches if b.request_id == rid]
        assert rid not in self.engine.prefixes
        self.results.append(result)

    def _lag(self) -> int:
        """Branches the scheduler has ended that the engine still holds."""
        running = self.driver.scheduler.statistics().running_branches
        return len(self.engine.live_branches) - running

    def _step_once(self) -> bool:
        lag, seen = self._lag(), len(self.engine.log)
        more = self.driver.step()
        for branch in self.engine.live_branches - self.started_at.keys():
            self.started_at[branch] = self.engine.steps
        if lag:
            event("cleanup step after the scheduler ended live branches")
            # The scheduler ended branches in the last step; this step only frees them (all
            # of them). A check answered within this step (a confidence source's costs no
            # time) may end more, which the next step frees in turn.
            # A check that pruned may also fork, in the slots it freed (after the abort).
            log = self.engine.log[seen:]
            assert {entry[0] for entry in log} <= {"abort", "release", "start"}
            for entry in log:
                if entry[0] == "start":
                    assert min(entry[2]) >= self.widths[entry[1]], "only forks start here"
            assert sum(len(entry[1]) for entry in log if entry[0] == "abort") >= lag
        # Rules may step many times; hold the invariants at every step, not only after the rule.
        self.within_batch_budget()
        self.live_branches_belong_to_unfinished_requests()
        self.finished_requests_hold_no_prefix()
        self.scheduler_running_within_engine_live()
        self.at_most_k_scores_in_flight()
        self.results_are_unique()
        self.at_most_n_live_per_request()
        starts = [e for e in self.engine.log[seen:] if e[0] == "start"]
        if any(max(e[2], default=0) >= self.widths[e[1]] for e in starts):
            event("forked branches")
        return more

    # ------------------------------------------------------------ rules

    @initialize(
        batch_size=st.integers(1, MAX_BATCH),
        admission=st.sampled_from(sart.Admission),
        every=intervals,
        attribute_failures=st.booleans(),
        scoring=st.sampled_from(sart.Scoring),
        prm_cost=st.integers(0, 40),
        max_scores=st.integers(1, 3),
        replicas=st.integers(1, 3),
        aging=st.none() | st.floats(1.0, 100.0),
    )
    def setup(
        self,
        batch_size: int,
        admission: sart.Admission,
        every: int,
        attribute_failures: bool,
        scoring: sart.Scoring,
        prm_cost: int,
        max_scores: int,
        replicas: int,
        aging: float | None,
    ) -> None:
        self.batch_size = batch_size
        table = LiveTable(self.scripts)
        self.engine = FakeEngine(table, max_branches=batch_size)
        self.prm = ScriptedPRM(table, every=every, attribute_failures=attribute_failures)
        # A PRM call takes ``prm_cost`` steps of virtual time: overlapped, rewards
        # arrive while decoding goes on.
        priced = sart.CostedPRM(self.prm, lambda _items: float(prm_cost), replicas=replicas)
        overlapped = scoring is sart.Scoring.OVERLAPPED
        self.max_scores = max_scores if overlapped else 1
        self.driver = sart.SyncDriver(
            self.engine,
            priced,
            batch_size=batch_size,
            admission=admission,
            scoring=scoring,
            max_scores=self.max_scores,
            aging=aging,
            on_result=self._deliver,
        )
        event(f"K={self.max_scores}, replicas={replicas}")
        self.ready = True

    @rule(
        parts=intervals.flatmap(lambda every: request_parts(every, forks=True)),
        lateness=st.floats(0.0, 1.0),
        # One request in four has a timeout, so that most still run to their end.
        timeout=st.integers(0, 3).flatmap(lambda k: st.floats(0.5, 200.0) if k == 3 else st.none()),
        priority=st.integers(0, 2),
    )
    def submit(
        self, parts: RequestParts, lateness: float, timeout: float | None, priority: int
    ) -> None:
        rid = f"r{len(self.submitted)}"
        arrival = self.engine.clock.now() * (1.0 - lateness)  # already arrived
        self.scripts[rid] = parts.scripts
        self.widths[rid] = parts.policy.n
        if parts.policy.forks:
            event("a policy that forks")
        request = sart.Request(
            rid, "p", parts.policy, parts.sampling, arrival, timeout=timeout, priority=priority
        )
        if request.deadline is not None:
            self.deadlines[rid] = request.deadline
        self.driver.submit(request)
        self.submitted.append(rid)

    @rule(times=st.integers(1, 6))
    def step(self, times: int) -> None:
        for _ in range(times):
            if not self._step_once():
                break

    @precondition(lambda self: bool(self.engine.live_branches))
    @rule(data=st.data(), kind=st.sampled_from((START, STEP, PRM_FAIL, PRM_NAN)))
    def inject_fault(self, data: st.DataObject, kind: str) -> None:
        branch = data.draw(st.sampled_from(sorted(self.engine.live_branches)), label="branch")
        if kind == START:
            self.engine.fail_start.add(branch.request_id)
        elif kind == STEP:
            tokens = self.engine.steps - self.started_at[branch]
            self.engine.fail_step[branch] = tokens + 1  # fails at its next decode
        elif kind == PRM_FAIL:
            self.prm.fail_on.add(branch)
        else:
            self.prm.nan_for.add(branch)
        self.faulted.add(branch.request_id)
        event(f"fault injected: {kind}")

    @precondition(lambda self: bool(self.submitted))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.submitted), label="request")
        finished = rid in {r.request_id for r in self.results}
        if self.driver.cancel(rid, "the test cancelled it"):
            assert not finished
            self.cancelled.add(rid)
            event("cancelled an open request")
        # False: finished, or ended in the scheduler with its result still to come.
        assert self.driver.cancel("never-submitted") is False

    @precondition(lambda self: bool(self.submitted))
    @rule()
    def drain(self) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self._step_once():
                break
        else:
            raise AssertionError(f"still busy after {MAX_DRAIN_STEPS} steps")
        ids = [r.request_id for r in self.results]
        assert sorted(ids) == sorted(self.submitted)
        for result in self.results:
            event(f"request {result.status.value}")
            if result.status is RequestStatus.FAILED:
                assert result.request_id in self.faulted, result.reason
            elif result.status is RequestStatus.CANCELLED:
                if result.reason == "the test cancelled it":
                    assert result.request_id in self.cancelled
                else:  # timed out: at its deadline or after, never before
                    assert result.reason.startswith("timed out"), result.reason
                    assert result.timings.finished >= self.deadlines[result.request_id]
                assert result.chosen is None and result.answer is None
                assert all(b.status.is_ended for b in result.branches)
            else:
                assert result.status is RequestStatus.COMPLETED
        assert self.engine.live_branches == frozenset()
        assert self.engine.prefixes == frozenset()
        assert self.driver.scheduler.statistics().running_branches == 0

    def teardown(self) -> None:
        if self.ready and self.submitted:
            self.drain()

    # ------------------------------------------------------------ invariants

    @invariant()
    def within_batch_budget(self) -> None:
        assert len(self.engine.live_branches) <= self.batch_size
        assert self.engine.peak_live <= self.batch_size

    @invariant()
    def at_most_n_live_per_request(self) -> None:
        live = Counter(b.request_id for b in self.engine.live_branches)
        for rid, count in live.items():
            assert count <= self.widths[rid], f"{rid} holds {count} live branches"

    @invariant()
    def live_branches_belong_to_unfinished_requests(self) -> None:
        finished = {r.request_id for r in self.results}
        for branch in self.engine.live_branches:
            assert branch.request_id in self.submitted
            assert branch.request_id not in finished

    @invariant()
    def finished_requests_hold_no_prefix(self) -> None:
        for result in self.results:
            assert result.request_id not in self.engine.prefixes

    @invariant()
    def scheduler_running_within_engine_live(self) -> None:
        assert self._lag() >= 0

    @invariant()
    def at_most_k_scores_in_flight(self) -> None:
        if self.ready:
            in_flight = self.driver.scheduler.scores_in_flight
            assert in_flight <= self.max_scores
            if in_flight > 1:
                event("more than one Score in flight")

    @invariant()
    def results_are_unique(self) -> None:
        ids = [r.request_id for r in self.results]
        assert len(ids) == len(set(ids))
        assert ids == [r.request_id for r in self.driver.results]


SchedulerMachine.TestCase.settings = settings(max_examples=examples(200), stateful_step_count=30)
test_scheduler_machine = SchedulerMachine.TestCase
