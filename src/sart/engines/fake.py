"""``FakeEngine``: a deterministic, scripted engine for tests, tutorials and benchmarks.

Public API in the manner of httpx's ``MockTransport``: every branch follows
its ``BranchScript``; one decode step costs ``step_cost`` on the engine's
``VirtualClock`` (1.0 by default, so time is measured in steps). It checks the
engine contract strictly (with a strict ``PrefixLedger``) and raises
``EngineMisuse`` (an ``AssertionError``) on a violation: touching an aborted
or ended branch, starting a branch twice, releasing a prefix whose branches
still run, exceeding ``max_branches``. It can inject failures for chosen
requests or branches. It pauses and resumes branches (``pause``,
``BranchSpec(resume=True)``): a resumed branch goes on from its script position,
paying a prefill of its tokens (``prefill_cost``; the simulator's cost model).

Log-probabilities: a request whose ``SamplingSettings.logprobs`` is ``k``
(not ``None``) gets one ``TokenLogprobs`` per new token in every
``BranchDelta``, from its branch's script (``BranchScript.logprobs_span``: the
scripted sampled-token logprob and ``k`` top values whose negative mean is the
scripted confidence; not a real distribution). A request that did not ask
costs nothing more.

With ``watch=True`` it has ``watchers`` (``sart.engines.base.watches_steps``), as
the transformers and vLLM engines do: a watched request's tokens go to its
callback one step at a time, during ``step``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from sart.clock import VirtualClock
from sart.engines.base import BranchDelta, BranchSpec, EngineStats, StepOutput, Watcher
from sart.engines.ledger import Prefix, PrefixLedger
from sart.engines.scripts import BranchScript, ScriptLike, as_script
from sart.errors import EngineError, EngineMisuse
from sart.types import EXTRA_SAMPLING, BranchId, FinishReason, Prompt, SamplingSettings


@attrs.define
class _Live:
    script: BranchScript
    end: int  # position at which the branch ends (EOS or max_tokens)
    reason: FinishReason
    pos: int = 0
    logprobs: int | None = None  # the request's SamplingSettings.logprobs


class FakeEngine:
    """A scripted engine with a virtual clock. See the module docstring.

    It supports forking (``BranchSpec(parent=j)``): the child continues from
    the parent's position with the script's ``fork(child, parent, position)``
    if the script has one, else with the parent's own script.

    Failure injection (each raises ``EngineError`` naming the request, before
    changing any state):

    - ``fail_prefill``: request ids whose prefill fails;
    - ``fail_start``: request ids whose ``start_branches`` fails;
    - ``fail_step``: ``{branch_id: k}``: the step call in which that branch
      would generate its ``k``-th token fails;
    - ``fail_pause``: request ids whose branches' ``pause`` fails.
    """

    supports_fork = True
    supports_pause = True
    # Scripts, not sampling: every field is taken (and changes nothing).
    sampling_fields = frozenset(EXTRA_SAMPLING)

    def __init__(
        self,
        script: ScriptLike = None,
        *,
        max_branches: int | None = None,
        step_cost: float = 1.0,
        prefill_cost: float = 0.0,
        fail_prefill: Collection[str] = (),
        fail_start: Collection[str] = (),
        fail_step: Mapping[BranchId, int] | None = None,
        fail_pause: Collection[str] = (),
        watch: bool = False,
    ) -> None:
        self.script = as_script(script)
        self.max_branches = max_branches
        self.step_cost = step_cost
        self.prefill_cost = prefill_cost
        self.fail_prefill = set(fail_prefill)
        self.fail_start = set(fail_start)
        self.fail_step: dict[BranchId, int] = dict(fail_step or {})
        self.fail_pause = set(fail_pause)
        self.clock = VirtualClock()
        self.log: list[tuple[object, ...]] = []
        """Every call, as ``(operation, args...)``, for tests to inspect."""
        self.peak_live = 0
        self.steps = 0
        self.watchers: dict[str, Watcher] | None = {} if watch else None
        """With ``watch``: requests whose tokens go to a callback step by step."""
        # Strict: misuse raises EngineMisuse, and releasing a prefix with live branches too.
        self._ledger: PrefixLedger[None, _Live] = PrefixLedger(strict=True)

    # ------------------------------------------------------------- contract

    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self.log.append(("prefill", request_id))
        self._ledger.check_prefill(request_id)
        if request_id in self.fail_prefill:
            raise EngineError(f"injected prefill failure for {request_id!r}", [request_id])
        tokens = max(1, len(prompt.split()) if isinstance(prompt, str) else len(prompt))
        self._ledger.prefill(request_id, tokens, sampling, None)
        self.clock.advance(self._prefill_time(tokens))
        return tokens

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        self.log.append(("start", request_id, tuple(b.index for b in branches)))
        prefix = self._ledger.check_start(request_id, branches)
        live = len(self._live)
        if self.max_branches is not None and live + len(branches) > self.max_branches:
            raise EngineMisuse(
                f"starting {len(branches)} branches would exceed max_branches={self.max_branches} "
                f"({live} live)"
            )
        if request_id in self.fail_start:
            raise EngineError(f"injected start failure for {request_id!r}", [request_id])
        max_tokens = prefix.sampling.max_tokens
        k = prefix.sampling.logprobs
        new: list[tuple[BranchSpec, _Live]] = []
        resumed = 0
        for spec in branches:
            bid = BranchId(request_id, spec.index)
            if spec.resume:  # goes on from its kept position: its tokens are recomputed
                paused = self._ledger.paused[bid]
                new.append((spec, attrs.evolve(paused)))
                resumed += paused.pos
                continue
            if spec.parent is None:
                script, pos = self.script(bid), 0
            else:  # a fork copies its parent's tokens (copy-on-fork)
                parent = BranchId(request_id, spec.parent)
                script, pos = self._fork_script(bid, parent), self._live[parent].pos
            if script.length <= max_tokens:
                new.append((spec, _Live(script, script.length, FinishReason.STOP, pos, k)))
            else:
                new.append((spec, _Live(script, max_tokens, FinishReason.LENGTH, pos, k)))
        self._ledger.start(request_id, new)
        self.peak_live = max(self.peak_live, len(self._live))
        if resumed:
            self.clock.advance(self._prefill_time(resumed))

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        self.log.append(("step", max_steps, until_first_end))
        if max_steps < 1:
            raise EngineMisuse(f"step(max_steps={max_steps})")
        if not self._live:
            return StepOutput(steps=0, deltas={})
        left = [b.end - b.pos for b in self._live.values()]
        horizon = min(max_steps, min(left) if until_first_end else max(left))
        for bid, k in self.fail_step.items():
            live = self._live.get(bid)
            if live is not None and live.pos < k <= live.pos + min(horizon, live.end - live.pos):
                raise EngineError(
                    f"injected decode failure at token {k} of branch {bid}", [bid.request_id]
                )
        cost = self._decode_time(horizon)  # priced before the branches move
        deltas: dict[BranchId, BranchDelta] = {}
        for bid, live in list(self._live.items()):
            n = min(horizon, live.end - live.pos)
            text = live.script.text_span(live.pos, live.pos + n)
            logprobs = (
                ()
                if live.logprobs is None
                else live.script.logprobs_span(live.pos, live.pos + n, live.logprobs)
            )
            watcher = self.watchers.get(bid.request_id) if self.watchers else None
            if watcher is not None:
                self._tell(watcher, bid, live, n)
            live.pos += n
            if live.pos == live.end:
                deltas[bid] = BranchDelta(
                    new_tokens=n, text=text, finish=live.reason, end_offset=n, logprobs=logprobs
                )
                if watcher is not None:
                    watcher(bid, BranchDelta(0, "", live.reason, n))
                self._ledger.end(bid)
            else:
                deltas[bid] = BranchDelta(new_tokens=n, text=text, logprobs=logprobs)
        self.steps += horizon
        self.clock.advance(cost)
        return StepOutput(steps=horizon, deltas=deltas)

    @staticmethod
    def _tell(watcher: Watcher, bid: BranchId, live: _Live, n: int) -> None:
        """Hand the branch's next ``n`` tokens to ``watcher``, one step each (``step``
        then tells it of the branch's end, if it ended)."""
        for pos in range(live.pos, live.pos + n):
            logprobs = (
                ()
                if live.logprobs is None
                else live.script.logprobs_span(pos, pos + 1, live.logprobs)
            )
            watcher(bid, BranchDelta(1, live.script.text_span(pos, pos + 1), logprobs=logprobs))

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        self.log.append(("abort", tuple(branch_ids)))
        self._ledger.abort(branch_ids)

    def pause(self, branch_ids: Sequence[BranchId]) -> None:
        """End these live branches now, keeping their script positions for a resume."""
        self.log.append(("pause", tuple(branch_ids)))
        failing = sorted({b.request_id for b in branch_ids} & self.fail_pause)
        if failing:
            raise EngineError(f"injected pause failure for {failing}", failing)
        self._ledger.pause(list(branch_ids), keep=lambda live: live)

    def release_prefix(self, request_id: str) -> None:
        self.log.append(("release", request_id))
        self._ledger.release(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(live_branches=len(self._live), kv_tokens=self._kv_tokens)

    def _fork_script(self, child: BranchId, parent: BranchId) -> BranchScript:
        """The child's behaviour: the script's ``fork`` if it has one (traces
        draw a continuation from another branch), else the parent's own script."""
        fork = getattr(self.script, "fork", None)
        live = self._live[parent]
        if fork is None:
            return live.script
        return fork(child, parent, live.pos)

    # ----------------------------------------------------- cost (overridable)

    def _prefill_time(self, prompt_tokens: int) -> float:
        return self.prefill_cost

    def _decode_time(self, steps: int) -> float:
        """Time for the live branches to decode ``steps`` steps (each stops at its end)."""
        return steps * self.step_cost

    # -------------------------------------------------------------- helpers

    def usage(self, request_id: str) -> tuple[int, int]:
        """``(live branches, KV tokens)`` held by one request (0, 0 if it holds nothing)."""
        return self._ledger.usage(request_id, _position)

    @property
    def prefixes(self) -> frozenset[str]:
        """Requests whose prefix is held."""
        return frozenset(self._ledger.prefixes)

    @property
    def live_branches(self) -> frozenset[BranchId]:
        return frozenset(self._live)

    # The ledger's views under the names SimEngine's cost model reads.

    @property
    def _prefixes(self) -> Mapping[str, Prefix[None]]:
        return self._ledger.prefixes

    @property
    def _live(self) -> Mapping[BranchId, _Live]:
        return self._ledger.branches

    @property
    def _kv_tokens(self) -> int:
        return self._ledger.kv_tokens(_position)


def _position(live: _Live) -> int:
    """A branch's own KV tokens: its position (a fork's inherited tokens included)."""
    return live.pos


__all__ = ["BranchScript", "EngineMisuse", "FakeEngine"]
