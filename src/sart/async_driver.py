"""The asyncio driver: the same scheduler and policies on streaming engines, as a service.

``AsyncDriver`` runs the loop the synchronous driver runs (``DriverBase._step``,
written once) and performs its effects by awaiting: engine methods may be
coroutines (``StreamingEngine`` adapters: vLLM's ``AsyncLLM``,
OpenAI-compatible servers, SGLang) or plain functions (the step-based
engines), and the PRM runs in a worker thread so that a slow reward model
does not stall the event loop — with overlapped scoring the loop keeps
decoding meanwhile. Two ways to use it:

- ``await driver.run(requests)``: serve a batch, like ``SyncDriver.run``;
- a server: start ``driver.serve()`` as a task, then ``await
  driver.generate(request)`` from any number of handlers; ``driver.stop()``
  lets ``serve`` return once everything submitted has finished.

Since the loop is the synchronous driver's, Algorithm 1's semantics, failures
confined to their requests and the results do not depend on which driver
runs them.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable
from typing import Any

from sart.commands import Done, Score
from sart.driver import DriverBase, Effect, Outcome, Returned, _Call, _StartScore, advance
from sart.request import Request
from sart.results import RequestResult
from sart.score_runner import PendingScore
from sart.types import Scoring


class AsyncDriver(DriverBase):
    """Runs requests through a ``Scheduler`` on the event loop (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._futures: dict[str, asyncio.Future[RequestResult]] = {}
        self._wakeup = asyncio.Event()
        self._stopping = False

    def submit(self, request: Request) -> None:
        super().submit(request)
        self._wakeup.set()

    async def generate(self, request: Request) -> RequestResult:
        """Submit ``request`` and wait for its result (``serve()`` must be running).

        Cancelling the caller (a client that went away, a timeout) cancels the
        request, as vLLM's ``AsyncLLM.generate`` aborts its request: its branches
        are aborted in the engine at the driver's next step."""
        future = asyncio.get_running_loop().create_future()
        self.submit(request)  # first: a refused id must not take its namesake's future
        self._futures[request.id] = future
        try:
            return await future
        except asyncio.CancelledError:
            self._futures.pop(request.id, None)
            self.cancel(request.id)
            raise

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        cancelled = super().cancel(request_id, reason)
        self._wakeup.set()  # serve() may be waiting for work
        return cancelled

    async def run(self, requests: Iterable[Request] = ()) -> list[RequestResult]:
        """Submit ``requests``, serve until everything has finished, return the results
        in submission order."""
        requests = self._submit_all(requests)
        try:
            while await self.step():
                pass
        finally:
            self.close()
        return self._results_of(requests)

    async def serve(self) -> None:
        """Serve submissions until ``stop()`` is called and everything has finished.

        If serving fails (an ``on_result`` callback raised, a bug), every
        ``generate()`` still waiting gets the exception rather than waiting for ever."""
        try:
            while True:
                if not await self.step():
                    if self._stopping:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
        except BaseException as exc:
            futures, self._futures = self._futures, {}
            for future in futures.values():
                if future.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(exc)
            raise

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    async def step(self) -> bool:
        """One batch of commands carried out, awaiting the engine's and the PRM's
        coroutines (or one wait); ``False`` once nothing is left to do."""
        loop = self._step()
        effect = advance(loop, (None, None))
        while not isinstance(effect, Returned):
            effect = advance(loop, await self._attempt(effect))
        return effect.more

    async def _attempt(self, effect: Effect) -> Outcome:
        try:
            return await self._perform(effect), None
        except Exception as exc:  # the loop turns it into a Failed event
            return None, exc

    async def _perform(self, effect: Effect) -> Any:
        if isinstance(effect, _Call):
            value = effect.fn(*effect.args)
            return await value if inspect.isawaitable(value) else value
        if isinstance(effect, _StartScore):
            return await self._start_score(effect.command)
        await self._wait(effect.until)
        return None

    async def _start_score(self, command: Score) -> PendingScore:
        scores = self.scores
        if scores.virtual:
            return scores.price(command)
        if self.scoring is Scoring.BLOCKING:
            # PRMs are blocking calls: a thread keeps the event loop free meanwhile.
            return scores.waited(command, await asyncio.to_thread(scores.timed, command.items))
        future = asyncio.get_running_loop().run_in_executor(
            scores.executor(), scores.timed, command.items
        )
        return PendingScore(command, future=future)

    async def _wait(self, until: float | None) -> None:
        pending = self.scores.pending
        start = self.clock.now()
        if self.scores.virtual:  # a virtual clock jumps
            targets = [t for t in (until, *(p.ready_at for p in pending)) if t is not None]
            self.clock.sleep_until(min(targets))
        else:
            # Wake for a Score, the next arrival, or a new submission (serving).
            self._wakeup.clear()
            wakeup = asyncio.ensure_future(self._wakeup.wait())
            waits: set[asyncio.Future[Any]] = {wakeup, *(p.future for p in pending)}
            timeout = None if until is None else max(0.0, until - start)
            await asyncio.wait(waits, timeout=timeout, return_when="FIRST_COMPLETED")
            if not wakeup.done():
                wakeup.cancel()
        if pending:
            self.scores.stalled(self.clock.now() - start)

    def _finished(self, result: RequestResult) -> Done:
        done = super()._finished(result)
        future = self._futures.pop(result.request_id, None)
        if future is not None and not future.done():
            future.set_result(self.results[-1])
        return done
