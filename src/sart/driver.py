"""The one loop that carries out the scheduler's commands, shared by both drivers.

A driver owns the effects the scheduler only decides: calling the engine and
the PRM, reading the clock, releasing requests at their arrival times, and
collecting results and the resource timeline. Engine and PRM exceptions are
turned into ``Failed`` events for the requests they affect, an
``AssertionError`` too (a model's or a PRM's own ``assert``); only
``EngineMisuse`` (sart driving an engine out of protocol, which the fake
engine reports: a bug of sart's) is let through.

The loop is written once, in ``DriverBase._step``: a generator that yields
the effects it needs (call an engine method, start scoring, wait) and gets
their results back. ``SyncDriver`` (``sart.sync_driver``) performs them by
calling, the asyncio driver (``sart.async_driver``) by awaiting; that is the only
difference.

Scoring (``sart.Scoring``): how a ``Score`` runs -- priced on a virtual clock,
on worker threads, or blocking -- and the PRM time each request is charged are
``sart.score_runner``'s. Up to ``max_scores`` (``K``) overlapped ``Score``
commands are in flight at once: by default as many as the PRM has workers
(``prm_workers``: 1 for a plain PRM; a PRM pool or a client of several PRM
servers says how many calls it takes side by side). Which reward source scores
each request is ``sart.rewards``'.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

import attrs

from sart.clock import Clock, WallClock
from sart.commands import (
    Abort,
    Command,
    Decode,
    Decoded,
    Done,
    Event,
    Failed,
    Finish,
    Pause,
    Prefill,
    Prefilled,
    Refusal,
    ReleasePrefix,
    Score,
    Skipped,
    StartBranches,
    Started,
)
from sart.engines.base import engine_clock, supports_pause
from sart.errors import (
    ConfigError,
    EngineError,
    EngineMisuse,
    RequestRefused,
    SchedulerError,
    enum_converter,
)
from sart.messages import StepOutput
from sart.prm.base import PRM
from sart.request import Request
from sart.results import RequestResult
from sart.rewards.isolation import prm_workers
from sart.rewards.router import RewardRouter
from sart.scheduler import Scheduler, SchedulerConfig
from sart.score_runner import ScoreRunner
from sart.servable import check_servable
from sart.types import Admission, Scoring


@attrs.frozen
class TimelineSample:
    """Resource use right after one decode call (the paper's Figure 3)."""

    time: float
    running_branches: int
    kv_tokens: int


# ------------------------------------------------------------------ effects of the loop


@attrs.frozen
class _Call:
    """Call an engine method (the async driver awaits what it returns, if awaitable)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]


@attrs.frozen
class _StartScore:
    """Start carrying out a ``Score``; the performer answers with a ``_PendingScore``."""

    command: Score


@attrs.frozen
class _Wait:
    """Nothing to do: wait for the Score in flight, or until ``until`` (an arrival)."""

    until: float | None


Effect = _Call | _StartScore | _Wait

Outcome = tuple[Any, BaseException | None]
"""What carrying out an effect gave: its value, or the exception it raised."""


@attrs.frozen
class Returned:
    """The loop of one ``step`` returned: whether there is more to do."""

    more: bool


def advance(loop: Generator[Effect, Any, bool], outcome: Outcome) -> Effect | Returned:
    """Answer ``loop``'s last effect with ``outcome`` (its value sent in, or its exception
    thrown in: the loop turns it into a ``Failed`` event); the next effect, or
    ``Returned`` once the loop is done."""
    value, error = outcome
    try:
        return loop.send(value) if error is None else loop.throw(error)
    except StopIteration as stop:
        return Returned(bool(stop.value))


_ENGINE_CALLS = ("prefill", "start_branches", "step", "abort", "release_prefix", "stats")


def _check_parts(engine: object, prm: object) -> None:
    """Refuse (``ConfigError``) an engine or a PRM that is not one, now rather than as
    an ``AttributeError`` in the loop or a failure of every request."""
    missing = [name for name in _ENGINE_CALLS if not callable(getattr(engine, name, None))]
    if missing:
        raise ConfigError(
            f"engine={engine!r} must be an engine (sart.Engine or an async one): "
            f"it has no {missing[0]}()"
        )
    if prm is not None and not callable(getattr(prm, "score", None)):
        raise ConfigError(f"prm={prm!r} must be a PRM (it has score(items)) or None")


class DriverBase:
    """What the synchronous and the asyncio drivers share: intake, the loop, the mapping
    from commands to engine/PRM calls and back to events, and result bookkeeping.

    ``clock`` defaults to the engine's own virtual clock if it has one, else
    the wall clock. ``on_result`` is called with each result as it is
    finished. ``scoring``, ``poll_steps``, ``aging`` and ``pause`` go to
    ``SchedulerConfig``; ``pause`` (``None``: whether the engine ``supports_pause``)
    lets urgent requests pause less urgent ones' branches.
    """

    def __init__(
        self,
        engine: Any,
        prm: PRM | None = None,
        *,
        batch_size: int,
        admission: Admission | str = Admission.CHUNK,
        scoring: Scoring | str = Scoring.OVERLAPPED,
        poll_steps: int | None = None,
        aging: float | None = None,
        pause: bool | None = None,
        max_scores: int | None = None,
        clock: Clock | None = None,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> None:
        _check_parts(engine, prm)
        self.engine = engine
        self.prm = prm
        self.clock: Clock = clock or engine_clock(engine) or WallClock()
        blocking = enum_converter(Scoring, "scoring")(scoring) is Scoring.BLOCKING
        self.scheduler = Scheduler(
            SchedulerConfig(
                batch_size=batch_size,
                admission=admission,
                scoring=scoring,
                poll_steps=poll_steps,
                aging=aging,
                pause=supports_pause(engine) if pause is None else pause,
                max_scores=(1 if blocking else prm_workers(prm))
                if max_scores is None
                else max_scores,
            )
        )
        self.results: list[RequestResult] = []
        """Results in the order requests finished."""
        self.timeline: list[TimelineSample] = []
        self._on_result = on_result
        self._arrivals: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()
        self._open: set[str] = set()  # submitted, result not delivered
        self._delivered: list[RequestResult] = []  # finished, not yet given to on_result
        # Requests whose policy brings its own reward source (Policy.reward), and those
        # whose prefix the engine holds (their source is released with it).
        self.rewards = RewardRouter(prm)
        """Which source scores each request, and scoring on it (``sart.rewards``)."""
        self.scores = ScoreRunner(
            self.rewards,
            prm,
            self.clock,
            scoring=self.scheduler.config.scoring,
            max_scores=self.scheduler.config.max_scores,
            running=self.scheduler.running_request_ids,
            open_requests=self._open,
        )
        """The Scores in flight and the PRM time they cost (``sart.score_runner``)."""

    @property
    def scoring(self) -> Scoring:
        return self.scheduler.config.scoring

    @property
    def prm_busy(self) -> float:
        """Seconds the PRM spent scoring, over the run."""
        return self.scores.prm_busy

    @property
    def prm_wait(self) -> float:
        """Seconds the loop stood still waiting for the PRM while branches were running."""
        return self.scores.prm_wait

    @property
    def open_requests(self) -> int:
        """Requests submitted whose result has not been delivered yet (its load, for a
        router placing requests on replicas)."""
        return len(self._open)

    def is_open(self, request_id: str) -> bool:
        """Whether a request of this id was submitted and its result not delivered yet
        (``submit`` refuses another of that id until then)."""
        return request_id in self._open

    def submit(self, request: Request) -> None:
        """Queue a request; it reaches the scheduler at ``request.arrival``.

        Its id must differ from every request submitted and not finished yet
        (``ConfigError`` now, rather than a failure once it arrives)."""
        if request.id in self._open:
            raise ConfigError(
                f"id={request.id!r} must be unique: a request with this id is already "
                "submitted and not finished"
            )
        check_servable(request, request.policy.reward or self.prm, self.engine)
        self.rewards.add(request)
        heapq.heappush(self._arrivals, (request.arrival, next(self._seq), request))
        self._open.add(request.id)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Cancel a submitted request that has not finished (``Scheduler.cancel``): its
        result, ``RequestStatus.CANCELLED`` with ``reason``, is delivered like any
        other, its branches are aborted in the engine and its prefix released. One
        that has not arrived yet ends at once, without reaching the engine.
        ``False`` if no such request is open.

        It takes effect at the driver's next step (a running decode call finishes
        first). Call it from the thread that runs the driver (for ``AsyncDriver``,
        its event loop)."""
        if request_id not in self._open:
            return False
        for at, (_, _, request) in enumerate(self._arrivals):
            if request.id == request_id:  # not arrived: the scheduler ends it at once
                self._arrivals.pop(at)
                heapq.heapify(self._arrivals)
                self.scheduler.submit(request)
                break
        return self.scheduler.cancel(request_id, reason)

    def _submit_all(self, requests: Iterable[Request]) -> list[Request]:
        """Submit a batch, refusing it whole (before anything runs) if two share an id:
        results are returned by id, and one would hide the other."""
        requests = list(requests)
        seen: set[str] = set()
        repeats: set[str] = set()
        for request in requests:
            (repeats if request.id in seen else seen).add(request.id)
        repeated = sorted(repeats)
        if repeated:
            raise ConfigError(f"request ids must be unique in one run; repeated: {repeated}")
        for request in requests:
            self.submit(request)
        return requests

    def close(self) -> None:
        """Stop the PRM worker threads, if any were started (a later run starts others)."""
        self.scores.close()

    def _admit_arrivals(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] <= now:
            self.scheduler.submit(heapq.heappop(self._arrivals)[2])

    def _results_of(self, requests: Sequence[Request]) -> list[RequestResult]:
        by_id = {r.request_id: r for r in self.results}
        return [by_id[r.id] for r in requests]

    # ------------------------------------------------------------------ the loop

    def _step(self) -> Generator[Effect, Any, bool]:
        """One step of the loop: carry out one batch of commands, or wait once.
        Returns ``False`` when there is nothing left to do."""
        self._collect()
        now = self.clock.now()
        self._admit_arrivals(now)
        cmds = self.scheduler.next_commands(now)
        if not cmds:
            if not self.scores.pending and not self._arrivals:
                if not self.scheduler.idle:  # stopping here would lose its open requests
                    raise SchedulerError("the scheduler has open requests and no command")
                return False
            # Until the next arrival or deadline (or a Score's rewards).
            wake = [self._arrivals[0][0]] if self._arrivals else []
            deadline = self.scheduler.next_deadline()
            if deadline is not None:
                wake.append(deadline)
            yield _Wait(min(wake, default=None))
            self._collect()
            return True
        answers: dict[int, Event] = {}
        failed: set[str] = set()
        for cmd in cmds:
            if isinstance(cmd, Score):
                self.scores.pending.append((yield _StartScore(cmd)))
                continue
            ids = (
                cmd.request_ids
                if isinstance(cmd, (Prefill, StartBranches, Abort, Pause, ReleasePrefix))
                else frozenset()
            )
            # An earlier command of this request failed: skip what builds on it. An Abort
            # is always carried out (it is never answered Skipped): the branches it names
            # run whatever failed before it (a fork's start, before its request's cancel).
            if ids & failed and not isinstance(cmd, Abort):
                answers[cmd.id] = Skipped()
                continue
            fn, args, to_event = self._effect(cmd)
            try:
                event = to_event((yield _Call(fn, args)) if fn is not None else None)
            except EngineMisuse:  # sart's own bug: a test must see it, not a failed request
                raise
            except Exception as exc:
                event = self._failure(exc)
            if isinstance(event, Failed):
                failed |= ids
            answers[cmd.id] = event
        if answers:
            self.scheduler.handle(answers, self.clock.now())
        self._collect()  # a blocking (or instant) Score is answered within its step
        self._deliver()
        return True

    def _collect(self) -> None:
        """Hand the rewards of finished Scores to the scheduler."""
        self.scores.collect(
            lambda cmd_id, scored: self.scheduler.handle({cmd_id: scored}, self.clock.now())
        )

    # ------------------------------------------------------------------ commands

    def _effect(
        self, cmd: Command
    ) -> tuple[Callable[..., Any] | None, tuple[Any, ...], Callable[[Any], Event]]:
        """The call a command needs (``None``: none), its arguments, and how its
        return value becomes the event. Sync or async, the engine is called the
        same way; only whether the driver awaits differs."""
        engine = self.engine
        if isinstance(cmd, Decode):
            return engine.step, (cmd.max_steps, cmd.until_first_end), self._decoded
        if isinstance(cmd, Prefill):
            req = cmd.request
            return (
                engine.prefill,
                (req.id, req.prompt, self.rewards.sampling(req)),
                self._prefilled(req.id),
            )
        if isinstance(cmd, StartBranches):
            return engine.start_branches, (cmd.request_id, cmd.branches), lambda _: Started()
        if isinstance(cmd, Abort):
            return engine.abort, (cmd.branches,), lambda _: Done()
        if isinstance(cmd, Pause):
            return engine.pause, (cmd.branches,), lambda _: Done()
        if isinstance(cmd, ReleasePrefix):
            return (
                engine.release_prefix,
                (cmd.request_id,),
                lambda _: self._released(cmd.request_id),
            )
        if isinstance(cmd, Finish):
            return None, (), lambda _: self._finished(cmd.result)
        raise TypeError(f"unknown command {cmd!r}")

    @staticmethod
    def _failure(exc: Exception) -> Failed:
        if isinstance(exc, RequestRefused):
            return Failed(str(exc), exc.request_ids or None, Refusal(exc.field))
        if isinstance(exc, EngineError):
            return Failed(str(exc), exc.request_ids or None)
        return Failed(f"{type(exc).__name__}: {exc}")

    def _prefilled(self, request_id: str) -> Callable[[Any], Event]:
        def event(prompt_tokens: Any) -> Event:
            self.rewards.hold(request_id)
            return Prefilled(prompt_tokens)

        return event

    def _decoded(self, output: StepOutput) -> Decoded:
        self.rewards.observe(output)
        stats = self.engine.stats()
        self.timeline.append(TimelineSample(self.clock.now(), stats.live_branches, stats.kv_tokens))
        self.scheduler.observe(stats.kv_tokens, stats.kv_capacity)
        return Decoded(output)

    def _released(self, request_id: str) -> Done:
        self.scores.release(request_id)
        return Done()

    def _finished(self, result: RequestResult) -> Done:
        rid = result.request_id
        self._open.discard(rid)
        self.rewards.finished(rid)
        busy, wait = self.scores.charges(rid)
        result = attrs.evolve(result, prm_seconds=busy, prm_wait_seconds=wait)
        self.results.append(result)
        self._delivered.append(result)
        return Done()

    def _deliver(self) -> None:
        """Hand finished results to ``on_result``, outside the engine calls, so that an
        exception in the user's callback reaches the caller instead of failing a
        cleanup command."""
        delivered, self._delivered = self._delivered, []
        if self._on_result is not None:
            for result in delivered:
                self._on_result(result)
