"""``Service``: the driver behind the HTTP layer — admission, cancellation, results, metrics.

One ``sart.AsyncDriver`` serves every request on the server's event loop,
over a ``ServingEngine`` (sync engines on a worker thread, cancellation) and
the PRM (timed; a ``PRMProcess`` runs it in its own process). ``submit``
and ``result`` are what a handler calls:

- the request is refused at once (``QueueFull``, HTTP 429) when
  ``max_queue`` requests already wait for a slot, so latency stays bounded;
- if the handler is cancelled (its client disconnected) or calls ``cancel``,
  the request is cancelled in the engine and every branch of it is aborted (see
  ``sart.serve.engine``); its result is counted as ``cancelled``;
- the result comes back with its prompt length, for ``usage``;
- when the server is told to stop, ``drain`` refuses new requests, gives those in
  flight a grace period, then cancels the rest with a reason
  (``SHUTTING_DOWN``), so that every handler still answers (503) before the HTTP
  server closes the connections: an answer, not a dropped connection; ``stop``
  then cancels the PRM's calls in flight, where it can (``ServedPRM.cancel``).

The driver keeps a history of results and of its resource timeline, which
a benchmark wants and a server does not: the service drops both as each
request finishes, so memory stays flat however long the server runs.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

import attrs

from sart.async_driver import AsyncDriver
from sart.clock import WallClock
from sart.engines.base import ChecksHealth
from sart.errors import SartError
from sart.prm.base import PRM
from sart.request import Request
from sart.results import RequestResult
from sart.servable import check_servable
from sart.serve.config import ServeConfig
from sart.serve.engine import ServingEngine
from sart.serve.metrics import ServeMetrics, gauge_table
from sart.serve.prm import ServedPRM

_log = logging.getLogger("sart.serve")

#: What a request that needs PRM rewards is told when the server has none.
_NO_PRM = "this server has no PRM (start it with --prm); methods that need none: vanilla, sc"

SHUTTING_DOWN = "the server is shutting down"
"""Why requests still running past the shutdown grace period are cancelled, and why new
ones are refused meanwhile."""


async def context_length(engine: Any) -> int | None:
    """An engine's context length: vLLM's ``max_model_len``, transformers' and SGLang's
    ``context_len``, a gateway's (``OpenAIEngine.context_length``, its upstreams'
    ``max_model_len``); a ``SyncBridge``'s engine's. ``None`` where none says."""
    engine = getattr(engine, "engine", engine) if hasattr(engine, "loop") else engine
    for name in ("max_model_len", "context_len"):
        value = getattr(engine, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    ask = getattr(engine, "context_length", None)
    if inspect.iscoroutinefunction(ask):
        try:
            value = await ask()
        except Exception:  # an upstream that does not answer: unsaid, not a failure
            return None
        return value if isinstance(value, int) and value > 0 else None
    return None


class QueueFull(SartError):
    """``max_queue`` requests already wait for a slot."""


class ServiceStopped(SartError):
    """The service is not running (starting, stopping, or its driver failed)."""


@attrs.frozen
class Outcome:
    """A finished request, as the HTTP layer answers it."""

    result: RequestResult
    prompt_tokens: int
    shutdown: bool = False
    """Cancelled because the server is shutting down (``Service.drain``)."""


class Service:
    """Runs an ``AsyncDriver`` for the server; see the module docstring."""

    def __init__(self, engine: Any, prm: PRM | None, config: ServeConfig) -> None:
        self.config = config
        self.metrics = ServeMetrics(self._gauges)
        self.engine = ServingEngine(
            engine, on_prefill=self._prefilled, on_prefilled=self._took_prompt
        )
        self.prm = None if prm is None else ServedPRM(prm, self.metrics.observe_prm)
        self.driver = AsyncDriver(
            self.engine,
            self.prm,
            batch_size=config.batch_size,
            admission=config.admission,
            scoring=config.scoring,
            aging=config.aging,
            clock=WallClock(),
            on_result=self._finished,
        )
        self._task: asyncio.Task[None] | None = None
        self._waiting: set[str] = set()  # accepted, not prefilled, not cancelled
        self._running: set[str] = set()  # prefilled, not finished
        self._max_tokens: dict[str, int] = {}  # of each request in flight
        # Accepted and not yet taken by result() or cancel(): each request's outcome,
        # set by the driver's on_result (so that the outcome, its prompt length and
        # the metrics are all settled in one place, when the driver delivers it).
        self._futures: dict[str, asyncio.Future[Outcome]] = {}
        # Set when the engine has taken the request's prompt (``started``).
        self._took: dict[str, asyncio.Future[None]] = {}
        self._draining = False  # told to stop: new requests are refused
        self._shut: set[str] = set()  # cancelled by drain

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start serving (on the running event loop)."""
        self._task = asyncio.create_task(self.driver.serve(), name="sart-driver")
        self._task.add_done_callback(self._driver_ended)

    def _driver_ended(self, task: asyncio.Task[None]) -> None:
        """If the driver failed, every request still waiting gets its exception."""
        error = None if task.cancelled() else task.exception()
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error or ServiceStopped("the server stopped"))

    @property
    def healthy(self) -> bool:
        """The driver runs and the server is not shutting down (``health`` asks the
        engine too)."""
        return self._task is not None and not self._task.done() and not self._draining

    @property
    def draining(self) -> bool:
        """Told to stop (``drain``): no new requests are taken."""
        return self._draining

    async def drain(self, grace: float, settle: float = 5.0) -> None:
        """Stop taking requests; give those in flight ``grace`` seconds to finish, then
        cancel the rest (``SHUTTING_DOWN``) and wait up to ``settle`` seconds for their
        results, so that each handler answers before the HTTP server lets go of its
        connection (uvicorn cancels the handlers still running after its own grace
        period: the client then got a bare 500, or a stream cut short, and the log a
        traceback per request)."""
        self._draining = True
        in_flight = list(self._futures.values())
        if in_flight and grace > 0:
            await asyncio.wait(in_flight, timeout=grace)
        left = [rid for rid, future in self._futures.items() if not future.done()]
        for rid in left:
            self._shut.add(rid)
            # As a client's cancel, but the future stays: the driver delivers the
            # cancelled result (at its next step, not after a decode call or a check
            # in flight), and the handler answers it.
            self.engine.cancel(rid, SHUTTING_DOWN)
            self.driver.cancel(rid, SHUTTING_DOWN)
        settling = [self._futures[rid] for rid in left if rid in self._futures]
        if settling:
            await asyncio.wait(settling, timeout=settle)

    async def health(self) -> str | None:
        """Why the server cannot serve now (``None``: it can): its driver stopped, it is
        shutting down (``drain``), or its engine says it cannot (``ChecksHealth``:
        vLLM's engine core dead, no upstream of a gateway able to serve)."""
        if not self.healthy:
            return SHUTTING_DOWN if self._draining else "the driver is not running"
        inner = self.engine.inner
        if isinstance(inner, ChecksHealth):
            try:
                await inner.check_health()
            except Exception as exc:
                return str(exc)
        return None

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet answered (``/load``'s ``server_load``)."""
        return len(self._futures)

    async def max_model_len(self) -> int | None:
        """The engine's context length in tokens (``None`` where it does not say):
        ``/v1/models``' and ``/tokenize``'s ``max_model_len``, as vLLM's."""
        return await context_length(self.engine.inner)

    async def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still in flight, let the driver finish, stop it."""
        if self._task is None:
            return
        for request_id in list(self._futures):
            self.cancel(request_id)
        if self.prm is not None:
            # Its checks in flight are of requests that have ended: the driver waits for
            # them, and a hung PRM server held the process for its --prm-timeout.
            self.prm.cancel()
        self.driver.stop()
        try:
            await asyncio.wait_for(self._task, timeout)
        except asyncio.TimeoutError:
            pass  # wait_for cancelled it
        except Exception:
            pass  # the driver failed; /health has been saying so
        finally:
            self.driver.close()
            self.engine.close()

    # ------------------------------------------------------------ requests

    def check(self, request: Request) -> None:
        """Refuse, before it runs, a request this server cannot serve (``ConfigError``):
        a policy that needs a PRM when there is none, or forks on an engine that cannot
        (``sart.servable.check_servable``, with the server's own hint)."""
        # The wrapped engine, so that the message names the engine the user chose.
        check_servable(
            request, request.policy.reward or self.prm, self.engine.inner, no_prm=_NO_PRM
        )

    def submit(self, request: Request, question: str | None = None) -> str:
        """Accept ``request`` (its ``arrival`` is set to now) and return its id; then
        ``await result(id)``, or ``cancel(id)``. Raises ``ServiceStopped``,
        ``ConfigError`` (see ``check``) or ``QueueFull`` without accepting it.

        ``question``: the text the PRM sees as the prompt, for a request whose
        prompt is token ids (a chat rendered by its template)."""
        if self._draining:
            raise ServiceStopped(SHUTTING_DOWN)
        if not self.healthy:
            raise ServiceStopped("the server is not serving")
        self.check(request)
        if len(self._waiting) >= self.config.max_queue:
            raise QueueFull(
                f"{len(self._waiting)} requests are waiting for a slot (the server's "
                f"--max-queue is {self.config.max_queue}); retry later"
            )
        rid = request.id
        self.driver.submit(attrs.evolve(request, arrival=self.driver.clock.now()))
        self._futures[rid] = asyncio.get_running_loop().create_future()
        self._took[rid] = asyncio.get_running_loop().create_future()
        self._waiting.add(rid)
        self._max_tokens[rid] = request.sampling.max_tokens
        if self.engine.live_branches() < self.config.batch_size:
            self.engine.arrived()
        if question is not None and self.prm is not None:
            self.prm.ask(rid, question)
        return rid

    def is_open(self, request_id: str) -> bool:
        """Whether a request of this id was submitted and its result not yet taken (or,
        cancelled, not yet delivered by the driver): ``submit`` refuses the id then."""
        return request_id in self._futures or self.driver.is_open(request_id)

    async def started(self, request_id: str, timeout: float | None = None) -> None:
        """Wait until the engine has taken an accepted request's prompt (prefilled), or
        the request has ended (refused, failed, cancelled), or ``timeout`` seconds. A
        stream opens then, so that a prompt the engine refuses is answered with an
        HTTP error, as ``vllm serve`` answers it, not with an event in a 200 stream."""
        took, future = self._took.get(request_id), self._futures.get(request_id)
        # No ``took`` left: the prompt was taken (or the request cancelled) already,
        # perhaps before the caller got here (an engine that prefills at once).
        if took is None or future is None or took.done() or future.done():
            return
        waits: list[asyncio.Future[Any]] = [took, future]
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    def ended(self, request_id: str) -> Outcome | None:
        """An accepted request's outcome if it has ended and is not yet taken (by
        ``result``), else ``None``."""
        future = self._futures.get(request_id)
        if future is None or not future.done() or future.cancelled():
            return None
        return future.result() if future.exception() is None else None

    async def result(self, request_id: str) -> Outcome:
        """Wait for an accepted request's result. If the caller is cancelled (its client
        disconnected), the request is cancelled: every branch of it is aborted."""
        future = self._futures[request_id]
        try:
            # Shielded: the request ends by the engine's abort (cancel), not by a
            # cancellation that would only stop waiting for it.
            outcome = await asyncio.shield(future)
        except asyncio.CancelledError:
            self.cancel(request_id)
            raise
        finally:
            if future.done():
                self._futures.pop(request_id, None)
        return outcome

    def cancel(self, request_id: str) -> None:
        """Cancel an accepted request unless it has finished: a waiting one leaves the
        queue at the driver's next step, a running one has its branches aborted at
        the next engine call (see ``sart.serve.engine``). Idempotent."""
        self._took.pop(request_id, None)
        future = self._futures.pop(request_id, None)
        if future is None or future.done():  # taken, or finished as the client left
            return
        self._waiting.discard(request_id)
        # The engine refuses its next call at once, even mid-step; the driver ends it
        # at its next step, so that a waiting one leaves the queue then, not when its
        # turn comes.
        self.engine.cancel(request_id)
        self.driver.cancel(request_id, "the client disconnected")
        future.cancel()

    # ------------------------------------------------------------ bookkeeping

    def _prefilled(self, request_id: str) -> None:
        self._waiting.discard(request_id)
        self._running.add(request_id)

    def _took_prompt(self, request_id: str) -> None:
        took = self._took.pop(request_id, None)
        if took is not None and not took.done():
            took.set_result(None)

    def _finished(self, result: RequestResult) -> None:
        rid = result.request_id
        cancelled = self.engine.cancelled(rid)
        prompt_tokens = self.engine.prompt_tokens.get(rid)
        if prompt_tokens is None and self.prm is not None:
            self.prm.forget(rid)  # never prefilled: the PRM is never told to release it
        prompt_tokens = prompt_tokens or 0
        self.engine.forget(rid)
        self._took.pop(rid, None)
        self._waiting.discard(rid)
        self._running.discard(rid)
        max_tokens = self._max_tokens.pop(rid, 1)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        future = self._futures.get(rid)
        shutdown = rid in self._shut
        self._shut.discard(rid)
        self.metrics.observe(result, cancelled=cancelled, max_tokens=max_tokens, shutdown=shutdown)
        if cancelled and not shutdown:
            # Nobody is answered, so no line says it otherwise (a failure, a timeout
            # and a shutdown are logged as they are answered: sart.serve.app).
            _log.info(
                "%s: the client disconnected: cancelled after %.2f s, %d tokens generated",
                rid,
                result.timings.end_to_end,
                result.generated_tokens,
            )
        if future is not None and not future.done():
            future.set_result(Outcome(result, prompt_tokens, shutdown=shutdown))
        # A server keeps no history (the driver keeps one for benchmarks).
        self.driver.results.clear()
        self.driver.timeline.clear()

    def _gauges(self) -> dict[str, tuple[str, float]]:
        stats = self.driver.scheduler.statistics()
        engine = self.engine.stats()
        return gauge_table(
            {
                "sart:num_requests_running": len(self._running),
                "sart:num_requests_waiting": len(self._waiting),
                "sart:num_branches_running": stats.running_branches,
                "sart:num_branches_waiting": stats.queued_branches,
                "sart:engine_live_branches": engine.live_branches,
                "sart:kv_tokens": engine.kv_tokens,
            }
        )
