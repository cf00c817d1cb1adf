"""Shared Hypothesis strategies for the scheduler's property tests.

One module, in the manner of attrs' ``tests/strategies.py``. The central
strategy is ``workloads()``: a list of requests (arrival times, policies drawn
from the stock recipes or assembled from stock parts, per-branch
``BranchScript``s, ``max_tokens`` caps that truncate some branches), a batch
budget ``B``, an admission mode, a PRM ``every`` that usually equals the
interval ``T`` and sometimes does not, and injected faults (engine prefill,
start and decode failures, PRM exceptions and NaN rewards), and how checks
are scored: blocking (Algorithm 1) or overlapped with decoding, with a PRM
whose calls take random amounts of virtual time (``prm_costs``, cycled), so
that rewards land after a random number of decode steps. A ``Workload``
builds fresh ``FakeEngine``/``ScriptedPRM`` pairs, so the same workload can
be run twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import attrs
from hypothesis import settings
from hypothesis import strategies as st

import sart
from sart.engines.costs import compute_bound
from sart.testing import BranchScript, FakeEngine, ScriptedPRM

ANSWERS = ("42", "41", "7")
MAX_N = 8
MAX_LENGTH = 60
MAX_TOKENS = 80
MAX_INTERVAL = 20
MAX_BATCH = 16
MAX_ARRIVAL = 30

#: Hypothesis' own default; profiles that raise ``max_examples`` scale every test.
BASE_MAX_EXAMPLES = 100

PREFILL, START, STEP, PRM_FAIL, PRM_NAN = "prefill", "start", "step", "prm_fail", "prm_nan"
FAULT_KINDS = (PREFILL, START, STEP, PRM_FAIL, PRM_NAN)
POLICY_KINDS = (
    "sart",
    "self_consistency",
    "vanilla",
    "sart_without_pruning",
    "custom",
    "deepconf",
    "sart_confidence",
    "sart_adaptive",
)


def examples(n: int) -> int:
    """``n`` examples under the default profile, scaled up by the loaded profile
    (``--slow`` loads one with 10x hypothesis' default ``max_examples``)."""
    return n * max(1, settings.default.max_examples // BASE_MAX_EXAMPLES)


# ---------------------------------------------------------------- building blocks

#: Rewards in [0, 1]: round values (ties, exact thresholds) and arbitrary floats.
rewards = st.one_of(st.sampled_from((0.0, 0.25, 0.5, 0.75, 1.0)), st.floats(0.0, 1.0))

intervals = st.integers(1, MAX_INTERVAL)

arrivals = st.one_of(
    st.integers(0, MAX_ARRIVAL),
    st.floats(0.0, MAX_ARRIVAL, allow_nan=False, allow_infinity=False),
)

branch_scripts = st.builds(
    BranchScript,
    length=st.integers(1, MAX_LENGTH),
    answer=st.sampled_from(ANSWERS),
    rewards=st.lists(rewards, max_size=4).map(tuple),
    final_reward=st.none() | rewards,
)

#: Branches with scripted log-probabilities, for the policies that score with their own
#: confidence (drawn only for those: the extra lists slow every other example down).
confident_scripts = st.builds(
    BranchScript,
    length=st.integers(1, MAX_LENGTH),
    answer=st.sampled_from(ANSWERS),
    confidences=st.lists(st.floats(0.0, 20.0), max_size=4).map(tuple),
    logprobs=st.lists(st.floats(-20.0, 0.0), max_size=4).map(tuple),
    logprob_every=st.integers(1, 16),
)

sampling_settings = st.builds(sart.SamplingSettings, max_tokens=st.integers(1, MAX_TOKENS))


@st.composite
def policies(draw: st.DrawFn, interval: int) -> sart.Policy:
    """A stock recipe, or a ``Policy`` assembled from stock stop/prune/select parts."""
    n = draw(st.integers(1, MAX_N))
    m = draw(st.integers(1, n))
    alpha = draw(rewards)
    beta = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(POLICY_KINDS))
    if kind == "sart":
        return sart.sart(n, m, alpha, beta, interval)
    if kind == "self_consistency":
        return sart.self_consistency(n, interval)
    if kind == "vanilla":
        return sart.vanilla(interval)
    if kind == "sart_without_pruning":
        return sart.sart_without_pruning(n, m, interval)
    if kind == "deepconf" and n >= 2:
        warmup = draw(st.integers(1, n - 1))
        keep = draw(st.sampled_from((10.0, 50.0, 90.0, 100.0)))
        window = draw(st.integers(1, 8))
        return sart.deepconf_online(n, warmup, keep, interval, window, top_k=2)
    if kind == "sart_confidence":
        return sart.sart_confidence(n, m, alpha, beta, interval, top_k=2)
    if kind == "sart_adaptive":
        floor = draw(st.integers(1, n))
        keep = draw(st.none() | st.integers(1, n))
        return sart.sart_adaptive(n, m, alpha, beta, interval, floor=floor, keep=keep)
    stops = [sart.AllDone(), sart.FirstM(m), *([sart.Agreement(m)] if m >= 2 else [])]
    stop = draw(st.sampled_from(stops))
    prune = draw(st.sampled_from([sart.NoPrune(), sart.TwoPhasePrune(alpha, beta)]))
    select = draw(st.sampled_from([sart.WeightedVote(), sart.MajorityVote(), sart.BestReward()]))
    return sart.Policy(n=n, stop=stop, prune=prune, select=select, interval=interval)


@st.composite
def rebranch_rules(draw: st.DrawFn) -> sart.Rebranch:
    """A ``Rebranch`` with any of its options."""
    return sart.Rebranch(
        parents=draw(st.sampled_from(("softmax", "top", "systematic"))),
        temperature=draw(st.none() | st.sampled_from((0.05, 0.2, 1.0))),
        until=draw(st.sampled_from((0.25, 0.5, 1.0))),
        refill_completed=draw(st.booleans()),
        stop_after=draw(st.none() | st.integers(1, 3)),
        token_budget=draw(st.none() | st.integers(1, 200)),
        when_idle=draw(st.booleans()),
        row_budget=draw(st.none() | st.sampled_from((0.5, 2.0))),
    )


@st.composite
def forking_policies(draw: st.DrawFn, interval: int) -> sart.Policy:
    """A policy that forks branches: Rebase, particle filtering, load-aware re-sharing
    (alone, or as ``sart_rebranch``), or a drawn seat-refilling ``Rebranch`` rule around
    a stock stop and prune rule."""
    n = draw(st.integers(1, MAX_N))
    m = draw(st.integers(1, n))
    kind = draw(st.sampled_from(("rebase", "particle", "sart_rebranch", "reshare", "custom")))
    if kind == "rebase":
        return sart.rebase(n, draw(st.sampled_from((0.05, 0.2, 1.0))), interval)
    if kind == "reshare":
        inner = sart.TwoPhasePrune(draw(rewards), draw(st.integers(0, n - 1)))
        prune = sart.Reshare(
            inner,
            draw(st.sampled_from((0.05, 0.2, 1.0))),
            row_budget=draw(st.sampled_from((None, 1.0))),
        )
        stop = draw(st.sampled_from([sart.AllDone(), sart.FirstM(m)]))
        return sart.Policy(n=n, stop=stop, prune=prune, interval=interval)
    if kind == "particle":
        return sart.particle_filter(n, interval, draw(st.none() | st.just(0.2)))
    if kind == "sart_rebranch":
        beta = draw(st.integers(0, n - 1))
        temperature = draw(st.sampled_from((0.05, 0.2, 1.0)))
        budget = draw(st.sampled_from((None, 0.5, 1.0, 4.0)))
        agree = draw(st.sampled_from((None, 2, 3)))
        return sart.sart_rebranch(n, m, draw(rewards), beta, interval, temperature, budget, agree)
    rule = draw(rebranch_rules())
    stop = draw(st.sampled_from([sart.AllDone(), sart.FirstM(m)]))
    prune = draw(st.sampled_from([sart.NoPrune(), sart.TwoPhasePrune(0.5, n // 2)]))
    return sart.Policy(n=n, stop=stop, prune=prune, interval=interval, rebranch=rule)


@attrs.frozen
class RequestParts:
    """What a request needs besides its id and arrival."""

    policy: sart.Policy
    scripts: tuple[BranchScript, ...]
    sampling: sart.SamplingSettings


@st.composite
def request_parts(draw: st.DrawFn, interval: int, forks: bool = False) -> RequestParts:
    """A policy, one script per branch, and sampling settings (``forks``: the policy may
    also be one that forks branches, one in three)."""
    if forks and draw(st.integers(0, 2)) == 0:
        policy = draw(forking_policies(interval))
    else:
        policy = draw(policies(interval))
    kind = branch_scripts if policy.reward is None else confident_scripts
    scripts = draw(st.lists(kind, min_size=policy.n, max_size=policy.n))
    return RequestParts(policy, tuple(scripts), draw(sampling_settings))


# ---------------------------------------------------------------- faults


@attrs.frozen
class Fault:
    """One injected fault: ``branch`` and ``token`` matter for the kinds that name them."""

    kind: str
    branch: int = 0
    token: int = 1


@st.composite
def faults(draw: st.DrawFn, n: int) -> tuple[Fault, ...]:
    """Usually none; otherwise one or two faults of distinct kinds (shrinks to none)."""
    if draw(st.integers(0, 3)) < 3:
        return ()
    kinds = draw(st.lists(st.sampled_from(FAULT_KINDS), min_size=1, max_size=2, unique=True))
    return tuple(
        Fault(kind, draw(st.integers(0, n - 1)), draw(st.integers(1, MAX_LENGTH + 5)))
        for kind in kinds
    )


# ---------------------------------------------------------------- workloads


@attrs.frozen
class Workload:
    """Requests plus everything needed to build a fresh engine and PRM for them."""

    requests: tuple[sart.Request, ...]
    scripts: Mapping[str, tuple[BranchScript, ...]]
    faults: Mapping[str, tuple[Fault, ...]]
    batch_size: int
    admission: sart.Admission
    prm_every: int
    attribute_failures: bool
    scoring: sart.Scoring = sart.Scoring.BLOCKING
    prm_costs: tuple[float, ...] = ()
    """Virtual seconds each PRM call takes, cycled (empty: every call is free)."""
    prm_shares_engine: bool = False

    def _faulted_branches(self, kind: str) -> dict[sart.BranchId, int]:
        return {
            sart.BranchId(rid, f.branch): f.token
            for rid, fs in self.faults.items()
            for f in fs
            if f.kind == kind
        }

    @property
    def delays_rewards(self) -> bool:
        """Whether rewards can arrive after more decoding (overlapped, on a PRM of its own
        that takes time); otherwise a run is step for step Algorithm 1's."""
        return (
            self.scoring is sart.Scoring.OVERLAPPED
            and not self.prm_shares_engine
            and any(cost > 0 for cost in self.prm_costs)
        )

    def ids_with(self, kind: str) -> frozenset[str]:
        """Requests with an injected fault of this kind."""
        return frozenset(rid for rid, fs in self.faults.items() if any(f.kind == kind for f in fs))

    @property
    def faulted(self) -> frozenset[str]:
        """Requests with any injected fault (only these may fail)."""
        return frozenset(rid for rid, fs in self.faults.items() if fs)

    def engine(self) -> FakeEngine:
        """A fresh fake engine that refuses to run more than ``B`` branches."""
        return FakeEngine(
            dict(self.scripts),
            max_branches=self.batch_size,
            fail_prefill=self.ids_with(PREFILL),
            fail_start=self.ids_with(START),
            fail_step=self._faulted_branches(STEP),
        )

    def scripted_prm(self) -> ScriptedPRM:
        """A fresh scripted PRM over the same scripts."""
        return ScriptedPRM(
            dict(self.scripts),
            every=self.prm_every,
            fail_on=self._faulted_branches(PRM_FAIL),
            nan_for=self._faulted_branches(PRM_NAN),
            attribute_failures=self.attribute_failures,
        )

    def prm(self, scripted: ScriptedPRM) -> sart.PRM:
        """``scripted``, priced with ``prm_costs`` when there are any."""
        if not self.prm_costs:
            return scripted
        costs = itertools.cycle(self.prm_costs)
        return sart.CostedPRM(
            scripted, lambda _items: next(costs), shares_engine=self.prm_shares_engine
        )


def branch_end(script: BranchScript, sampling: sart.SamplingSettings) -> int:
    """Tokens a branch generates if it runs to its end: EOS, or the ``max_tokens`` cap."""
    return min(script.length, sampling.max_tokens)


def branch_text(script: BranchScript, sampling: sart.SamplingSettings) -> str:
    """The text a branch has when it runs to its end."""
    return "".join(script.tokens()[: branch_end(script, sampling)])


@st.composite
def workloads(draw: st.DrawFn, max_requests: int = 6) -> Workload:
    """A whole workload; see the module docstring."""
    interval = draw(intervals)
    count = draw(st.integers(1, max_requests))
    requests, scripts, injected = [], {}, {}
    for i in range(count):
        rid = f"r{i}"
        # Mostly the workload's T; sometimes a request with its own interval.
        parts = draw(request_parts(draw(st.just(interval) | intervals)))
        prompt = draw(st.sampled_from(("what is 6 * 7?", (1, 2, 3), "p")))
        sampling, keep = parts.sampling, draw(st.booleans())  # keep_logprobs
        if keep and sampling.logprobs is None:
            sampling = attrs.evolve(sampling, logprobs=draw(st.integers(0, 2)))
        requests.append(
            sart.Request(rid, prompt, parts.policy, sampling, draw(arrivals), keep_logprobs=keep)
        )
        scripts[rid] = parts.scripts
        injected[rid] = draw(faults(parts.policy.n))
    scoring = draw(st.sampled_from(sart.Scoring))
    # Costs in decode steps (the fake engine's step costs 1): from free to several checks.
    costs = draw(st.lists(st.integers(0, 3 * MAX_INTERVAL), max_size=4).map(tuple))
    return Workload(
        requests=tuple(requests),
        scripts=scripts,
        faults=injected,
        batch_size=draw(st.integers(1, MAX_BATCH)),
        admission=draw(st.sampled_from(sart.Admission)),
        prm_every=draw(st.just(interval) | intervals),
        attribute_failures=draw(st.booleans()),
        scoring=scoring,
        prm_costs=tuple(map(float, costs)),
        prm_shares_engine=draw(st.booleans()),
    )


CPU_LIKE = compute_bound("cpu-like", fixed=2e-3, per_row=1e-3)
"""Steps of 2 ms + 1 ms a row: a row budget binds (on the fake engine it never does)."""
