"""The asyncio driver: the same scheduler and policies on streaming engines, as a service.

``AsyncDriver`` is the synchronous driver's loop with awaits: it carries out
the scheduler's commands against an engine whose methods may be coroutines
(``StreamingEngine`` adapters: vLLM's ``AsyncLLM``, OpenAI-compatible
servers, SGLang) or plain functions (the step-based engines), and runs the
PRM in a worker thread so that a slow reward model does not stall the event
loop. Two ways to use it:

- ``await driver.run(requests)``: serve a batch, like ``SyncDriver.run``;
- a server: start ``driver.serve()`` as a task, then ``await
  driver.generate(request)`` from any number of handlers; ``driver.stop()``
  lets ``serve`` return once everything submitted has finished.

The loop is the same one the synchronous driver runs, so Algorithm 1's
semantics, failures confined to their requests and the results do not
depend on which driver runs them.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable, Sequence

from sart.commands import (
    Command,
    Done,
    Event,
    Failed,
    Prefill,
    Score,
    Skipped,
    StartBranches,
)
from sart.driver import DriverBase
from sart.request import Request
from sart.results import RequestResult


class AsyncDriver(DriverBase):
    """Runs requests through a ``Scheduler`` on the event loop (see the module docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._futures: dict[str, asyncio.Future[RequestResult]] = {}
        self._wakeup = asyncio.Event()
        self._stopping = False

    def submit(self, request: Request) -> None:
        super().submit(request)
        self._wakeup.set()

    async def generate(self, request: Request) -> RequestResult:
        """Submit ``request`` and wait for its result (``serve()`` must be running)."""
        future = asyncio.get_running_loop().create_future()
        self._futures[request.id] = future
        self.submit(request)
        return await future

    async def run(self, requests: Iterable[Request] = ()) -> list[RequestResult]:
        """Submit ``requests``, serve until everything has finished, return the results
        in submission order."""
        requests = list(requests)
        for request in requests:
            self.submit(request)
        while await self.step():
            pass
        return self._results_of(requests)

    async def serve(self) -> None:
        """Serve submissions until ``stop()`` is called and everything has finished."""
        while True:
            if not await self.step():
                if self._stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    async def step(self) -> bool:
        """Carry out one batch of commands; ``False`` when there is nothing left to do."""
        now = self.clock.now()
        self._admit_arrivals(now)
        cmds = self.scheduler.next_commands(now)
        if not cmds:
            if not self._arrivals:
                return False
            delay = self._arrivals[0][0] - self.clock.now()
            if hasattr(self.clock, "advance"):  # a virtual clock jumps
                self.clock.sleep_until(self._arrivals[0][0])
            elif delay > 0:
                self._wakeup.clear()  # a new submission may come before the next arrival
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass
            return True
        events = await self._execute(cmds)
        self.scheduler.handle(events, self.clock.now())
        return True

    async def _execute(self, cmds: Sequence[Command]) -> list[Event]:
        events: list[Event] = []
        failed: set[str] = set()
        for cmd in cmds:
            ids = cmd.request_ids if isinstance(cmd, (Prefill, StartBranches)) else frozenset()
            if ids & failed:  # an earlier command of this request failed
                events.append(Skipped())
                continue
            fn, args, to_event = self._effect(cmd)
            try:
                if isinstance(cmd, Score):  # PRMs are blocking: keep the loop free
                    value = await asyncio.to_thread(fn, *args)  # type: ignore[arg-type]
                else:
                    value = fn(*args) if fn is not None else None
                    if inspect.isawaitable(value):
                        value = await value
                event = to_event(value)
            except AssertionError:
                raise
            except Exception as exc:
                event = self._failure(exc)
            if isinstance(event, Failed):
                failed |= ids
            events.append(event)
        return events

    def _finished(self, result: RequestResult) -> Done:
        done = super()._finished(result)
        future = self._futures.pop(result.request_id, None)
        if future is not None and not future.done():
            future.set_result(result)
        return done
