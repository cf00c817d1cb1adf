"""``ServingEngine``: any sart engine as the server's asyncio driver awaits it, with cancellation.

The server runs ``sart.AsyncDriver`` on its event loop, the loop that also
answers HTTP. Two things stand between that driver and an engine:

- **Step-based engines block.** ``HFEngine.step`` (or vLLM's ``LLMEngine``)
  computes for tens of milliseconds; called on the event loop it would stall
  every connection meanwhile. Their prefill and decode calls run here on one
  worker thread (``sart-engine``); their quick bookkeeping calls (start
  branches, abort, release) run on the loop, saving thread hops, except a
  ``SyncBridge``'s (an async engine on a loop of its own, such as SGLang's),
  which all run on the worker thread. The driver
  awaits each call before the next, so the engine is never used by two threads
  at once. Async engines (``StreamingEngine`` adapters) are awaited as they
  are.
- **A client that disconnects must free its branches now.** ``cancel(id)``
  marks a request; its next engine call is refused with
  ``EngineError(request_ids=[id])``, the contract's way to say "this call
  failed for that request only and changed nothing": the driver fails the
  request and aborts every branch of it in the engine (their KV is freed),
  while the other requests carry on. A cancelled request that waits for a
  slot is refused at its prefill and costs nothing; one with running branches
  is refused at the next decode call. A step-based engine's decode call
  cannot be interrupted, so there its branches leave the engine within one
  decode chunk (at most ``T``, or ``poll_steps`` while a PRM check is in
  flight). An async engine's call can wait much longer (a streaming step
  waits until every branch has made its tokens, with Self-Consistency until
  some branch ends), so there a cancel aborts the request's branches in the
  engine at once, during the call, and the driver learns of it at the next
  call as above (its own abort of those branches is then already done).

- **Requests on a streaming engine advance independently.** A server's
  requests are independent streams on the engine; lockstep across them (every
  branch of every request reporting the same steps per call, Algorithm 1 on a
  step engine) would make each new request, in its prefill, hold back every
  other one's reports and ends, and each arrival wait for the batch in flight
  (the gateway in front of ``vllm serve`` kept 0.3 of its throughput that
  way). So the wrapper turns on the engine's ``per_request_steps`` (lockstep
  within each request, as its checks need) and, when a request arrives while a
  slot is free (``arrived``), interrupts the step in flight so that it starts
  at once.
- **A step engine's decode chunk is long** (up to ``T`` steps: a vanilla
  request's is 400). Where the engine can be interrupted (``StepInterrupt``:
  the transformers and vLLM engines), an arrival for a free slot ends the
  chunk in flight after its current decode step, as on a streaming engine; and
  a streamed one-branch request's tokens reach its stream step by step
  (``listen``, through the engine's ``watchers``), not at the chunk's end, and
  its end ends the chunk within ``--stream-interval`` steps.

It also keeps what the HTTP layer needs from the engine without touching it
while it runs on the worker thread: each request's prompt length
(``prompt_tokens``, for ``usage``) and the engine's ``stats()`` as last read
(``/metrics`` may ask in the middle of a decode call).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from sart.engines.base import (
    BranchDelta,
    BranchSpec,
    EngineStats,
    StepOutput,
    engine_name,
    sampling_fields,
    supports_fork,
    supports_pause,
    watches_steps,
)
from sart.engines.sync_bridge import SyncBridge
from sart.errors import EngineError
from sart.serve.logprobs import TokenNames
from sart.types import BranchId, Prompt, SamplingSettings

CANCELLED = "the client disconnected"
"""The failure reason of a cancelled request's engine call."""


class ServingEngine:
    """Wraps ``engine`` (sync or async) for the server's driver; see the module docstring.

    ``on_prefill(request_id)`` is called when a request's prefill starts (it
    stops waiting for a slot then), ``on_prefilled(request_id)`` when it succeeded
    (the engine took the prompt: a stream may open)."""

    def __init__(
        self,
        engine: Any,
        *,
        on_prefill: Callable[[str], None] | None = None,
        on_prefilled: Callable[[str], None] | None = None,
    ) -> None:
        self.inner = engine
        self.supports_fork = supports_fork(engine)
        self.supports_pause = supports_pause(engine)
        self.sampling_fields = sampling_fields(engine)
        self.bridged_name = engine_name(engine)
        self.tokenizer = getattr(engine, "tokenizer", None)
        """The engine's tokenizer, if it has one (the chat template comes from it)."""
        self.token_names = None if self.tokenizer is None else TokenNames(self.tokenizer)
        """Its tokens' texts, as a response's ``logprobs`` name them."""
        self.prompt_tokens: dict[str, int] = {}
        """Prompt length of each request prefilled and not yet forgotten."""
        self._on_prefill = on_prefill
        self._on_prefilled = on_prefilled
        self._sync = not inspect.iscoroutinefunction(engine.step)
        self._thread = (
            concurrent.futures.ThreadPoolExecutor(1, "sart-engine") if self._sync else None
        )
        # A bridge runs an async engine on its own loop, which cannot run inside the
        # server's running loop: every one of its calls goes to the worker thread.
        self._quick_on_loop = not isinstance(engine, SyncBridge)
        self._stats = engine.stats()
        self._busy = False  # a call is running on the worker thread
        self._live: dict[str, set[int]] = {}
        self._cancelled: dict[str, str] = {}  # request id -> why (its calls' refusal)
        self._aborted: set[BranchId] = set()  # by a cancel, before the driver's abort
        self._cancel_wake = asyncio.Event()
        # A streaming engine on this loop, or a step engine on the worker thread, can be
        # interrupted from the loop (a SyncBridge, on a loop of its own, has no interrupt).
        self._interrupt = getattr(engine, "interrupt", None)
        if self._interrupt is not None and not self._sync:
            engine.per_request_steps = True
        self._early = (  # a streaming engine reports a listened request's tokens early
            not self._sync and self._interrupt is not None and hasattr(engine, "report_every")
        )
        self._watch = self._sync and watches_steps(engine)
        self.streams_tokens = self._early or self._watch
        """Whether a listened request's tokens reach its listener as the engine makes
        them, whatever the driver's decode chunks: a streaming engine's step returns early
        for them (``report_every``), a step engine hands each decode step's tokens over
        (``watchers``). Where not, a step reports them, every decode chunk."""
        self._listeners: dict[str, Callable[[BranchDelta], None]] = {}
        self._every: dict[str, int] = {}  # listened to, first token not yet reported
        self._held: dict[str, _Held] = {}  # watched: pieces not yet reported

    # ------------------------------------------------------------- arrivals

    def live_branches(self) -> int:
        """Branches started and not yet ended, as this wrapper saw them."""
        return sum(len(live) for live in self._live.values())

    def arrived(self) -> None:
        """A request arrived for a free slot: a streaming engine's step in flight
        returns now (each request reporting what all its branches have made), a step
        engine's after its current decode step, so that the driver prefills and starts
        it without waiting for a branch, or the decode chunk, to end."""
        if self._interrupt is not None:
            self._interrupt()

    # ------------------------------------------------------------- cancellation

    def cancel(self, request_id: str, reason: str = CANCELLED) -> None:
        """Refuse ``request_id``'s next engine call, saying ``reason``, so that the
        driver aborts it (an async engine's branches are aborted at once)."""
        self._cancelled.setdefault(request_id, reason)  # the first cause is the one
        self._cancel_wake.set()

    def cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def listen(self, request_id: str, on_delta: Callable[[BranchDelta], None], every: int) -> None:
        """Call ``on_delta`` with each of ``request_id``'s branches' news as the engine
        reports it, before the driver applies it (a server streaming the tokens of a
        request whose one branch is its answer); an engine that ``reports_early`` reports
        the request's first token at once and then whenever it has made ``every`` more,
        as vLLM's ``stream_interval``."""
        self._listeners[request_id] = on_delta
        if self._early:
            self._every[request_id] = every
            self.inner.report_every[request_id] = 1
        elif self._watch:
            self._held[request_id] = _Held(every)
            post = asyncio.get_running_loop().call_soon_threadsafe
            interrupt = self._interrupt

            def watcher(bid: BranchId, piece: BranchDelta) -> None:
                # On the worker thread, mid-step. Its branch's end ends the step within
                # ``every`` decode steps (the request's answer is then sent, not held until
                # the decode chunk ends; ends close together share one short step); the
                # piece is handled on the loop, before the step's own return is (both go
                # through the loop's queue, in order).
                if piece.finish is not None and interrupt is not None:
                    interrupt(every)
                post(self._watched, bid, piece)

            self.inner.watchers[request_id] = watcher

    def forget(self, request_id: str) -> None:
        """Drop what is kept of a finished request."""
        self._listeners.pop(request_id, None)
        self._every.pop(request_id, None)
        if self._early:
            self.inner.report_every.pop(request_id, None)
        elif self._watch:
            self.inner.watchers.pop(request_id, None)
            self._held.pop(request_id, None)
        self._cancelled.pop(request_id, None)
        self.prompt_tokens.pop(request_id, None)
        self._live.pop(request_id, None)
        self._aborted = {bid for bid in self._aborted if bid.request_id != request_id}

    def _refuse(self, request_id: str) -> None:
        if request_id in self._cancelled:
            raise EngineError(self._cancelled[request_id], request_ids=[request_id])

    # ------------------------------------------------------------- the contract

    async def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self._refuse(request_id)
        if self._on_prefill is not None:
            self._on_prefill(request_id)
        tokens = await self._call(self.inner.prefill, request_id, prompt, sampling)
        self.prompt_tokens[request_id] = tokens
        if self._on_prefilled is not None:
            self._on_prefilled(request_id)
        return tokens

    async def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        self._refuse(request_id)
        await self._call(self.inner.start_branches, request_id, branches, slow=False)
        self._live.setdefault(request_id, set()).update(spec.index for spec in branches)

    async def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        doomed = [rid for rid in self._cancelled if self._live.get(rid)]
        if doomed:
            # One call fails with one reason: those of another reason fail at the next.
            reason = self._cancelled[doomed[0]]
            same = [rid for rid in doomed if self._cancelled[rid] == reason]
            raise EngineError(reason, request_ids=same)
        if self._sync:
            output: StepOutput = await self._call(self.inner.step, max_steps, until_first_end)
        else:
            output = await self._async_step(max_steps, until_first_end)
        for bid, delta in output.deltas.items():
            if delta.finish is not None:
                self._ended(bid)
            if bid.request_id in self._held:  # watched: its news came piece by piece
                continue
            listener = self._listeners.get(bid.request_id)
            if listener is not None and (delta.new_tokens or delta.finish is not None):
                listener(delta)
                if delta.new_tokens and bid.request_id in self._every:
                    self.inner.report_every[bid.request_id] = self._every.pop(bid.request_id)
        return output

    async def abort(self, branch_ids: Sequence[BranchId]) -> None:
        left = [bid for bid in branch_ids if bid not in self._aborted]
        self._aborted.difference_update(branch_ids)
        if left:
            await self._call(self.inner.abort, left, slow=False)
        for bid in branch_ids:
            self._ended(bid)

    async def pause(self, branch_ids: Sequence[BranchId]) -> None:
        """Pause branches for a more urgent request (``priority``): they leave the live
        set until the driver resumes them with ``start_branches``."""
        await self._call(self.inner.pause, list(branch_ids), slow=False)
        for bid in branch_ids:
            self._ended(bid)

    async def release_prefix(self, request_id: str) -> None:
        await self._call(self.inner.release_prefix, request_id, slow=False)
        self._live.pop(request_id, None)

    def stats(self) -> EngineStats:
        """The engine's ``stats()``: read now, or, while a call runs on the worker
        thread, as of the last read (a sync engine is never touched from two threads
        at once)."""
        if not self._busy:
            self._stats = self.inner.stats()
        return self._stats

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    # ------------------------------------------------------------- plumbing

    async def _async_step(self, max_steps: int, until_first_end: bool) -> StepOutput:
        """The async engine's step; a cancel meanwhile aborts the cancelled requests'
        branches in the engine now (the step then no longer waits for them)."""
        step = asyncio.ensure_future(self.inner.step(max_steps, until_first_end))
        try:
            while True:
                self._cancel_wake.clear()
                wake = asyncio.ensure_future(self._cancel_wake.wait())
                await asyncio.wait({step, wake}, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                if step.done():
                    return step.result()
                doomed = [
                    BranchId(rid, index)
                    for rid in self._cancelled
                    for index in sorted(self._live.get(rid, ()))
                    if BranchId(rid, index) not in self._aborted
                ]
                if doomed:
                    await self.inner.abort(doomed)
                    self._aborted.update(doomed)
        finally:
            if not step.done():  # this call itself was cancelled
                step.cancel()

    def _watched(self, bid: BranchId, piece: BranchDelta) -> None:
        """A watched step engine's piece of a listened request: reported once the first
        token, then ``every`` more, are held, or with what is held at its branch's end."""
        held = self._held.get(bid.request_id)
        listener = self._listeners.get(bid.request_id)
        if held is None or listener is None:  # forgotten meanwhile
            return
        if piece.finish is not None:
            listener(held.take(piece))
            return
        held.pieces.append(piece)
        held.tokens += piece.new_tokens
        if held.tokens >= held.due:
            listener(held.take())

    def _ended(self, bid: BranchId) -> None:
        live = self._live.get(bid.request_id)
        if live is not None:
            live.discard(bid.index)

    async def _call(self, fn: Callable[..., Any], *args: Any, slow: bool = True) -> Any:
        """Await ``fn(*args)``: an async engine's coroutine as it is; a sync engine's
        ``slow`` calls (prefill, step) on the worker thread, its quick bookkeeping
        (start, abort, release) on the loop, which saves two thread hops per request."""
        if self._thread is None:
            return await fn(*args)
        if not slow and self._quick_on_loop:
            return fn(*args)
        self._busy = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        finally:
            self._busy = False


@attrs.define
class _Held:
    """A watched request's pieces not yet reported to its listener."""

    every: int
    due: int = 1  # tokens to hold before reporting: the first at once, then ``every``
    pieces: list[BranchDelta] = attrs.Factory(list)
    tokens: int = 0

    def take(self, end: BranchDelta | None = None) -> BranchDelta:
        """The held pieces as one delta (with ``end``'s ``finish``, its branch's end),
        emptied."""
        pieces, self.pieces = self.pieces, []
        self.tokens, self.due = 0, self.every
        joined = BranchDelta(
            sum(p.new_tokens for p in pieces),
            "".join(p.text for p in pieces),
            token_ids=tuple(t for p in pieces for t in p.token_ids),
            logprobs=tuple(lp for p in pieces for lp in p.logprobs),
        )
        if end is None:
            return joined
        return attrs.evolve(
            joined, finish=end.finish, end_offset=end.end_offset, stop_reason=end.stop_reason
        )
