"""``FakeEngine``: a deterministic, scripted engine for tests, tutorials and benchmarks.

Public API in the manner of httpx's ``MockTransport``: every branch follows
its ``BranchScript``; one decode step costs ``step_cost`` on the engine's
``VirtualClock`` (1.0 by default, so time is measured in steps). It checks the
engine contract strictly and raises ``EngineMisuse`` (an ``AssertionError``)
on a violation: touching an aborted or ended branch, starting a branch twice,
releasing a prefix whose branches still run, exceeding ``max_branches``. It
can inject failures for chosen requests or branches.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from sart.clock import VirtualClock
from sart.engines.base import BranchDelta, BranchSpec, EngineStats, StepOutput
from sart.engines.scripts import BranchScript, ScriptLike, as_script
from sart.errors import EngineError
from sart.types import BranchId, FinishReason, Prompt, SamplingSettings


class EngineMisuse(AssertionError):
    """The engine contract was violated (a bug in the caller, not a request failure)."""


@attrs.define
class _Prefix:
    tokens: int
    sampling: SamplingSettings
    started: set[int] = attrs.Factory(set)
    live: set[int] = attrs.Factory(set)


@attrs.define
class _Live:
    script: BranchScript
    end: int  # position at which the branch ends (EOS or max_tokens)
    reason: FinishReason
    pos: int = 0


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
      would generate its ``k``-th token fails.
    """

    supports_fork = True

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
    ) -> None:
        self.script = as_script(script)
        self.max_branches = max_branches
        self.step_cost = step_cost
        self.prefill_cost = prefill_cost
        self.fail_prefill = set(fail_prefill)
        self.fail_start = set(fail_start)
        self.fail_step: dict[BranchId, int] = dict(fail_step or {})
        self.clock = VirtualClock()
        self.log: list[tuple[object, ...]] = []
        """Every call, as ``(operation, args...)``, for tests to inspect."""
        self.peak_live = 0
        self.steps = 0
        self._prefixes: dict[str, _Prefix] = {}
        self._live: dict[BranchId, _Live] = {}
        self._kv_tokens = 0

    # ------------------------------------------------------------- contract

    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self.log.append(("prefill", request_id))
        if request_id in self._prefixes:
            raise EngineMisuse(f"prefill of {request_id!r}, whose prefix is already held")
        if request_id in self.fail_prefill:
            raise EngineError(f"injected prefill failure for {request_id!r}", [request_id])
        tokens = max(1, len(prompt.split()) if isinstance(prompt, str) else len(prompt))
        self._prefixes[request_id] = _Prefix(tokens=tokens, sampling=sampling)
        self._kv_tokens += tokens
        self.clock.advance(self._prefill_time(tokens))
        return tokens

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        self.log.append(("start", request_id, tuple(b.index for b in branches)))
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            raise EngineMisuse(f"start_branches for {request_id!r}, which has no prefix")
        indices = [b.index for b in branches]
        again = prefix.started.intersection(indices)
        if again or len(set(indices)) != len(indices):
            raise EngineMisuse(
                f"branches {sorted(again or indices)} of {request_id!r} started twice"
            )
        if self.max_branches is not None and len(self._live) + len(indices) > self.max_branches:
            raise EngineMisuse(
                f"starting {len(indices)} branches would exceed max_branches={self.max_branches} "
                f"({len(self._live)} live)"
            )
        parents = {b.index: self._parent(request_id, b.parent) for b in branches}
        if request_id in self.fail_start:
            raise EngineError(f"injected start failure for {request_id!r}", [request_id])
        max_tokens = prefix.sampling.max_tokens
        for index in indices:
            bid = BranchId(request_id, index)
            parent = parents[index]
            if parent is None:
                script, pos = self.script(bid), 0
            else:
                script, pos = self._fork_script(bid, parent), self._live[parent].pos
            if script.length <= max_tokens:
                live = _Live(script=script, end=script.length, reason=FinishReason.STOP, pos=pos)
            else:
                live = _Live(script=script, end=max_tokens, reason=FinishReason.LENGTH, pos=pos)
            self._live[bid] = live
            self._kv_tokens += pos  # a fork copies its parent's tokens (copy-on-fork)
            prefix.started.add(index)
            prefix.live.add(index)
        self.peak_live = max(self.peak_live, len(self._live))

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
            live.pos += n
            self._kv_tokens += n
            if live.pos == live.end:
                deltas[bid] = BranchDelta(new_tokens=n, text=text, finish=live.reason, end_offset=n)
                self._drop(bid)
            else:
                deltas[bid] = BranchDelta(new_tokens=n, text=text)
        self.steps += horizon
        self.clock.advance(cost)
        return StepOutput(steps=horizon, deltas=deltas)

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        self.log.append(("abort", tuple(branch_ids)))
        for bid in branch_ids:
            if bid not in self._live:
                raise EngineMisuse(f"abort of branch {bid}, which is not live")
        for bid in branch_ids:
            self._drop(bid)

    def release_prefix(self, request_id: str) -> None:
        self.log.append(("release", request_id))
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            raise EngineMisuse(f"release_prefix of {request_id!r}, which has no prefix")
        if prefix.live:
            raise EngineMisuse(
                f"release_prefix of {request_id!r} while branches {sorted(prefix.live)} are live"
            )
        del self._prefixes[request_id]
        self._kv_tokens -= prefix.tokens

    def stats(self) -> EngineStats:
        return EngineStats(live_branches=len(self._live), kv_tokens=self._kv_tokens)

    def _parent(self, request_id: str, parent: int | None) -> BranchId | None:
        if parent is None:
            return None
        pid = BranchId(request_id, parent)
        if pid not in self._live:
            raise EngineMisuse(f"fork from branch {pid}, which is not live")
        return pid

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
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            return (0, 0)
        live = [self._live[BranchId(request_id, j)] for j in prefix.live]
        return (len(live), prefix.tokens + sum(b.pos for b in live))

    @property
    def prefixes(self) -> frozenset[str]:
        """Requests whose prefix is held."""
        return frozenset(self._prefixes)

    @property
    def live_branches(self) -> frozenset[BranchId]:
        return frozenset(self._live)

    def _drop(self, bid: BranchId) -> None:
        live = self._live.pop(bid)
        self._kv_tokens -= live.pos
        self._prefixes[bid.request_id].live.discard(bid.index)


__all__ = ["BranchScript", "EngineMisuse", "FakeEngine"]
