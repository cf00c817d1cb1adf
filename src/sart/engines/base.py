"""The engine contract: what the driver asks of fake, sim, hf, vLLM and SGLang adapters.

An engine holds prefixes (one per request, the prompt's KV cache) and branches
(seeded continuations that share their request's prefix). The driver calls it
only in this order of life for each request::

    prefill(request_id, prompt, sampling)         once
    start_branches(request_id, [BranchSpec...])   one or more times
    step(max_steps, until_first_end)              advances every live branch
    abort([branch ids])                           frees those branches' KV now
    release_prefix(request_id)                    after all its branches ended

``Engine`` is the synchronous contract, ``AsyncEngine`` the same one with
``async`` methods (streaming engines; ``SyncBridge`` runs one under the
synchronous driver).

Optional capabilities are declared, not guessed: an engine that sets
``supports_fork = True`` accepts ``BranchSpec(parent=j)`` in
``start_branches`` (forking a partial branch; Rebase needs it; on vLLM/SGLang
a fork is a new request whose prompt is prompt + the parent's tokens, served
from the prefix cache), and an engine that implements ``ReportsUsage``
reports each request's resource use. An engine that sets ``supports_pause =
True`` implements ``pause(branch_ids)`` (end those live branches now and free
their KV, but keep their generated tokens) and accepts
``BranchSpec(resume=True)`` for a paused branch (it goes on from those tokens,
their KV recomputed: the prefix cache serves the prompt); the scheduler pauses
less urgent requests' branches for more urgent ones (``Request.priority``).
A step engine with a ``watchers`` mapping (``watches_steps``) hands each decode
step's tokens of a watched request to its callback as it makes them, during
``step`` (a server streams them without cutting the batch's decode chunks); one
with an ``interrupt()`` (``StepInterrupt``), called from another thread, ends
the ``step`` in flight after its current decode step (a server starts a request
that arrived for a free slot without waiting for the decode chunk to end).

Failures: raising ``EngineError(request_ids=...)`` says the call failed only
for those requests and changed nothing else; the driver fails them and goes
on. Any other exception fails every request the call involved.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from sart.clock import Clock
from sart.messages import BranchDelta, BranchSpec, StepOutput, TokenLogprobs
from sart.types import EXTRA_SAMPLING, BranchId, FinishReason, Prompt, SamplingSettings

Watcher = Callable[[BranchId, BranchDelta], None]
"""Called, on the thread running ``step``, with a branch and what one decode step made
of it (tokens, text, logprobs), then, if it ended, a piece of no tokens that says how
(``finish``, ``end_offset``, ``stop_reason``: as the step's output says it)."""


class StepInterrupt:
    """A step engine's ``interrupt``: ``interrupt(steps)``, called from any thread, makes
    the ``step`` in flight (or else the next one) return within ``steps`` more decode
    steps (1: after the one it is in; the soonest asked wins). The engine's loop asks
    ``taken()`` after each decode step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # asked on the loop's thread, taken on the engine's
        self._left: int | None = None

    def __call__(self, steps: int = 1) -> None:
        with self._lock:
            self._left = steps if self._left is None else min(self._left, steps)

    def taken(self) -> bool:
        """Whether the step must return now (one decode step done since the last call)."""
        if self._left is None:  # the common case, without the lock
            return False
        with self._lock:
            if self._left is None:
                return False
            if self._left > 1:
                self._left -= 1
                return False
            self._left = None
            return True


class StepDeltas:
    """Accumulates what each branch did over the decode steps of one ``step`` call,
    for adapters that decode step by step (transformers, vLLM); hands each step's
    piece of a watched request to its ``watchers`` callback as it is added."""

    def __init__(self, watchers: Mapping[str, Watcher] | None = None) -> None:
        self._watchers = watchers
        self._tokens: dict[BranchId, list[int]] = {}
        self._texts: dict[BranchId, list[str]] = {}
        self._ends: dict[BranchId, tuple[FinishReason, int]] = {}
        self._logprobs: dict[BranchId, list[TokenLogprobs]] = {}
        self._stop_reasons: dict[BranchId, str | int] = {}

    def add(
        self,
        branch: BranchId,
        token_ids: Sequence[int],
        text: str,
        logprobs: Sequence[TokenLogprobs] = (),
    ) -> None:
        """``logprobs``: one per token of ``token_ids`` when the request asked for them."""
        self._tokens.setdefault(branch, []).extend(token_ids)
        self._texts.setdefault(branch, []).append(text)
        if logprobs:
            self._logprobs.setdefault(branch, []).extend(logprobs)
        watcher = self._watchers.get(branch.request_id) if self._watchers else None
        if watcher is not None:
            piece = BranchDelta(len(token_ids), text, token_ids=tuple(token_ids))
            watcher(branch, attrs.evolve(piece, logprobs=tuple(logprobs)) if logprobs else piece)

    def end(
        self,
        branch: BranchId,
        reason: FinishReason,
        step: int,
        stop_reason: str | int | None = None,
    ) -> None:
        """The branch ended at ``step`` (1-based within the call); ``stop_reason``: the
        stop string or stop token id that ended it (``BranchDelta.stop_reason``)."""
        self._ends[branch] = (reason, step)
        if stop_reason is not None:
            self._stop_reasons[branch] = stop_reason
        watcher = self._watchers.get(branch.request_id) if self._watchers else None
        if watcher is not None:
            watcher(branch, BranchDelta(0, "", reason, step, stop_reason=stop_reason))

    def output(self, steps: int) -> StepOutput:
        deltas = {}
        for bid, ids in self._tokens.items():
            reason, offset = self._ends.get(bid, (None, None))
            deltas[bid] = BranchDelta(
                new_tokens=len(ids),
                text="".join(self._texts[bid]),
                finish=reason,
                end_offset=offset,
                token_ids=tuple(ids),
                logprobs=tuple(self._logprobs.get(bid, ())),
                stop_reason=self._stop_reasons.get(bid),
            )
        return StepOutput(steps=steps, deltas=deltas)


@attrs.frozen
class EngineStats:
    """Resource use, sampled by the driver for the metrics timeline."""

    live_branches: int
    """Branches started and not yet ended or aborted."""
    kv_tokens: int
    """KV-cache tokens held: prefixes plus branch tokens (shared prefix counted once)."""
    kv_capacity: int | None = None
    """Total KV-cache tokens the engine can hold, if known."""


@runtime_checkable
class Engine(Protocol):
    """A step-based engine adapter (see the module docstring for the call order)."""

    def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        """Compute the prompt's KV cache; return the prompt length in tokens."""
        ...

    def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        """Start these branches from the request's prefix (or fork them from a live
        parent branch). All start, or none (and it raises)."""
        ...

    def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        """Decode every live branch for up to ``max_steps`` steps.

        Returns early when every live branch has ended, or, with
        ``until_first_end``, as soon as any branch ends.
        """
        ...

    def abort(self, branch_ids: Sequence[BranchId]) -> None:
        """End these live branches now and free their KV cache."""
        ...

    def release_prefix(self, request_id: str) -> None:
        """Free the request's prefix; every branch of it has ended by now."""
        ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class AsyncEngine(Protocol):
    """The same contract for asynchronous engines (``StreamingEngine`` and its vLLM
    ``AsyncLLM``, SGLang and OpenAI-server adapters), for ``AsyncDriver``; under the
    synchronous driver, wrap one in ``sart.engines.sync_bridge.SyncBridge``."""

    async def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        """As ``Engine.prefill``."""
        ...

    async def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        """As ``Engine.start_branches``."""
        ...

    async def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        """As ``Engine.step``: returns once every live branch has made ``max_steps``
        tokens or ended (or, with ``until_first_end``, at the first end)."""
        ...

    async def abort(self, branch_ids: Sequence[BranchId]) -> None:
        """As ``Engine.abort``."""
        ...

    async def release_prefix(self, request_id: str) -> None:
        """As ``Engine.release_prefix``."""
        ...

    def stats(self) -> EngineStats: ...


# ------------------------------------------------------------ capabilities
# Optional parts of the contract. An engine declares them (an attribute, or the
# methods of a protocol below) and the driver and benchmarks ask for them by
# these names, never by probing for whatever attribute happens to be there.


@runtime_checkable
class ReportsUsage(Protocol):
    """An engine that reports each request's resource use (``sart bench`` samples it
    after every decode call for the per-request memory plots)."""

    @property
    def prefixes(self) -> frozenset[str]:
        """Requests whose prefix is held."""
        ...

    def usage(self, request_id: str) -> tuple[int, int]:
        """``(live branches, KV tokens)`` held by one request (0, 0 if it holds nothing)."""
        ...


@runtime_checkable
class ChecksHealth(Protocol):
    """An async engine that can say whether it can serve at all, beyond any one request:
    its engine core alive (vLLM's ``AsyncLLM``), some upstream server able to serve (the
    gateway). ``sart serve``'s ``/health`` asks it, so that a load balancer stops
    sending requests that could only fail."""

    async def check_health(self) -> None:
        """Return if it can serve; raise ``EngineError`` saying why not."""
        ...


def supports_pause(engine: object) -> bool:
    """Whether the engine can pause live branches (``pause(branch_ids)``: free their KV,
    keep their tokens) and resume them (``BranchSpec(resume=True)``)."""
    return bool(getattr(engine, "supports_pause", False))


def supports_fork(engine: object) -> bool:
    """Whether the engine can start a branch from a live branch's state."""
    return bool(getattr(engine, "supports_fork", False))


def watches_steps(engine: object) -> bool:
    """Whether the step engine hands a request's tokens to a callback as each decode step
    makes them (its ``watchers``: request id to ``Watcher``)."""
    return isinstance(getattr(engine, "watchers", None), dict)


def sampling_fields(engine: object) -> frozenset[str]:
    """The ``EXTRA_SAMPLING`` fields the engine honours (its ``sampling_fields``; none
    if it does not say): it takes a request that sets another only at its default."""
    return frozenset(getattr(engine, "sampling_fields", ()))


def engine_name(engine: object) -> str:
    """The engine's class name (a ``SyncBridge``'s: the one it runs)."""
    return str(getattr(engine, "bridged_name", type(engine).__name__))


def unhonoured_sampling(engine: object, sampling: SamplingSettings) -> dict[str, object]:
    """The fields ``sampling`` sets away from their defaults that ``engine`` does not honour."""
    honoured = sampling_fields(engine)
    return {k: v for k, v in sampling.extra_fields().items() if k not in honoured}


def engine_clock(engine: object) -> Clock | None:
    """The engine's own (virtual) clock, if it keeps one."""
    clock = getattr(engine, "clock", None)
    return clock if isinstance(clock, Clock) else None


__all__ = [
    "EXTRA_SAMPLING",
    "AsyncEngine",
    "BranchDelta",
    "BranchSpec",
    "ChecksHealth",
    "Engine",
    "EngineStats",
    "ReportsUsage",
    "StepDeltas",
    "StepOutput",
    "TokenLogprobs",
    "engine_clock",
    "engine_name",
    "sampling_fields",
    "supports_fork",
    "supports_pause",
    "unhonoured_sampling",
]
