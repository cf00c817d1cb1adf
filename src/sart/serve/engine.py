"""``ServingEngine``: any sart engine as the server's asyncio driver awaits it, with cancellation.

The server runs ``sart.AsyncDriver`` on its event loop, the loop that also
answers HTTP. Two things stand between that driver and an engine:

- **Step-based engines block.** ``HFEngine.step`` (or vLLM's ``LLMEngine``)
  computes for tens of milliseconds; called on the event loop it would stall
  every connection meanwhile. Their prefill and decode calls run here on one
  worker thread (``sart-engine``); their quick bookkeeping calls (start
  branches, abort, release) run on the loop, saving thread hops. The driver
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
  is refused at the next decode call, so its branches leave the engine
  within one decode chunk (at most ``T``, or ``poll_steps`` while a PRM check
  is in flight).

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

from sart.engines.base import BranchSpec, EngineStats, StepOutput, supports_fork
from sart.errors import EngineError
from sart.types import BranchId, Prompt, SamplingSettings

CANCELLED = "the client disconnected"
"""The failure reason of a cancelled request's engine call."""


class ServingEngine:
    """Wraps ``engine`` (sync or async) for the server's driver; see the module docstring.

    ``on_prefill(request_id)`` is called when a request's prefill starts (it
    stops waiting for a slot then)."""

    def __init__(self, engine: Any, *, on_prefill: Callable[[str], None] | None = None) -> None:
        self.inner = engine
        self.supports_fork = supports_fork(engine)
        self.tokenizer = getattr(engine, "tokenizer", None)
        """The engine's tokenizer, if it has one (the chat template comes from it)."""
        self.prompt_tokens: dict[str, int] = {}
        """Prompt length of each request prefilled and not yet forgotten."""
        self._on_prefill = on_prefill
        self._sync = not inspect.iscoroutinefunction(engine.step)
        self._thread = (
            concurrent.futures.ThreadPoolExecutor(1, "sart-engine") if self._sync else None
        )
        self._stats = engine.stats()
        self._busy = False  # a call is running on the worker thread
        self._live: dict[str, set[int]] = {}
        self._cancelled: set[str] = set()

    # ------------------------------------------------------------- cancellation

    def cancel(self, request_id: str) -> None:
        """Refuse ``request_id``'s next engine call, so that the driver aborts it."""
        self._cancelled.add(request_id)

    def cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def forget(self, request_id: str) -> None:
        """Drop what is kept of a finished request."""
        self._cancelled.discard(request_id)
        self.prompt_tokens.pop(request_id, None)
        self._live.pop(request_id, None)

    def _refuse(self, request_id: str) -> None:
        if request_id in self._cancelled:
            raise EngineError(CANCELLED, request_ids=[request_id])

    # ------------------------------------------------------------- the contract

    async def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self._refuse(request_id)
        if self._on_prefill is not None:
            self._on_prefill(request_id)
        tokens = await self._call(self.inner.prefill, request_id, prompt, sampling)
        self.prompt_tokens[request_id] = tokens
        return tokens

    async def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        self._refuse(request_id)
        await self._call(self.inner.start_branches, request_id, branches, slow=False)
        self._live.setdefault(request_id, set()).update(spec.index for spec in branches)

    async def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        doomed = [rid for rid in self._cancelled if self._live.get(rid)]
        if doomed:
            raise EngineError(CANCELLED, request_ids=doomed)
        output: StepOutput = await self._call(self.inner.step, max_steps, until_first_end)
        for bid, delta in output.deltas.items():
            if delta.finish is not None:
                self._ended(bid)
        return output

    async def abort(self, branch_ids: Sequence[BranchId]) -> None:
        await self._call(self.inner.abort, branch_ids, slow=False)
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
        if not slow:
            return fn(*args)
        self._busy = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        finally:
            self._busy = False
