"""``PRMProcess``: a PRM hosted in a child process, so that its checks really run beside decoding.

With overlapped checks (``sart.Scoring.OVERLAPPED``) the driver calls the PRM
on a worker thread while the loop keeps stepping the engine. Where the policy
and the PRM are both torch models in one Python process on CPUs (the
transformers engine), the two threads take turns on the interpreter lock for
every small operation, and small models barely overlap at all (measured on
the testbed: 30 decode steps and 10 PRM checks took 0.76 s one after the
other and 0.70 s on two threads). In a process of its own the PRM has its own
interpreter and the worker thread only waits on a pipe.

The PRM is built in the child by ``factory``, a picklable callable (for
instance ``functools.partial(QwenMathPRM.from_pretrained, path, **options)``),
in a process started with the ``spawn`` method (forking a process that holds
torch threads or a CUDA context is unsafe). ``score`` and ``release`` go down
one pipe in call order; ``score`` waits for its answer. A ``PRMError`` raised
in the child comes back with its ``request_ids``; any other exception comes
back as a ``RuntimeError`` with its type and message, which the driver
isolates request by request, as it does for a PRM in the same process.

A child that dies (killed for memory, a crash in native code) fails the call in
flight with ``PRMError`` and is started again at the next call, so a server
recovers (before, every later check failed, and with it every request that
needs rewards, while ``/health`` said 200). Its caches died with it: the new
child scores each branch from its start. A child that cannot be started again
fails the calls of the next ``RESTART_BACKOFF`` seconds at once, then is tried
again. ``close()`` (or leaving the ``with`` block) stops the child; it is a
daemon, so it never outlives the parent.

``PRMPool(factory, workers=K)`` hosts ``K`` such processes and scores on them
side by side: a request's items always go to one process (its cache is there;
``sart.prm.placement``), one ``score`` call sends each process the items it
holds, at once, and ``workers`` tells the driver to keep ``K`` checks in flight.
A process that fails (or died) fails only the requests it held.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sart.errors import ConfigError, PRMError
from sart.prm.base import PRM, ScoreItem
from sart.prm.placement import Placement, fan_out

_SCORE, _RELEASE, _CLOSE = "score", "release", "close"

RESTART_BACKOFF = 10.0
"""Seconds after a failed restart of a dead PRM process before the next try (the calls
meanwhile fail at once, rather than each loading the PRM again)."""

_log = logging.getLogger("sart.prm")


def _serve(conn: Any, factory: Callable[[], PRM]) -> None:
    """The child's loop (see ``_answer``); Ctrl-C reaches the whole process group, and
    the parent, not the child, reports it."""
    try:
        _answer(conn, factory)
    except KeyboardInterrupt:
        return


def _answer(conn: Any, factory: Callable[[], PRM]) -> None:
    """Build the PRM, then answer calls until told to close."""
    try:
        prm = factory()
    except Exception as exc:  # report why it could not start, then stop
        conn.send(("error", _describe(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:  # the parent is gone
            return
        if kind == _CLOSE:
            return
        try:
            if kind == _SCORE:
                conn.send(("ok", [float(r) for r in prm.score(payload)]))
            else:
                release = getattr(prm, "release", None)
                if release is not None:
                    release(payload)
                conn.send(("ok", None))
        except Exception as exc:
            conn.send(("error", _describe(exc)))


def _describe(exc: BaseException) -> tuple[str, str, tuple[str, ...] | None]:
    """An exception as plain data (exceptions with extra state do not all pickle)."""
    ids = tuple(exc.request_ids) if isinstance(exc, PRMError) else None
    return type(exc).__name__, str(exc), ids


def _rebuild(described: tuple[str, str, tuple[str, ...] | None]) -> Exception:
    name, message, ids = described
    if ids is not None:
        return PRMError(message, ids)
    if name == ConfigError.__name__:  # a bad setting (a PRM not found...) is one here too
        return ConfigError(message)
    return RuntimeError(f"{name} in the PRM process: {message}")


class PRMProcess:
    """A PRM built by ``factory`` in a child process (see the module docstring)."""

    def __init__(self, factory: Callable[[], PRM], *, start_timeout: float = 600.0) -> None:
        self._factory = factory
        self._start_timeout = start_timeout
        self._lock = threading.Lock()  # one call on the pipe at a time
        self._closed = False
        self._retry_at = 0.0  # after a failed restart: no new try before this time
        self._restart_error = ""
        self._process, self._conn = self._start()

    def _start(self) -> tuple[Any, Any]:
        """Spawn the child and wait until its PRM is built: its process and pipe end.
        Raises ``PRMError`` (or the child's ``ConfigError``), the child stopped."""
        context = multiprocessing.get_context("spawn")
        conn, child = context.Pipe()
        process = context.Process(
            target=_serve, args=(child, self._factory), name="sart-prm", daemon=True
        )
        process.start()
        child.close()
        try:
            if not conn.poll(self._start_timeout):
                raise PRMError(f"the PRM process did not start within {self._start_timeout} s")
            try:
                kind, payload = conn.recv()
            except EOFError:
                raise PRMError(
                    f"the PRM process exited before it was ready (exit code {process.exitcode})"
                ) from None
            if kind == "error":
                raise _rebuild(payload)
        except BaseException:
            _stop(process, conn)
            raise
        return process, conn

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        return self._call(_SCORE, list(items))

    def release(self, request_id: str) -> None:
        if not self._process.is_alive():  # what it held died with it
            return
        self._call(_RELEASE, request_id)

    def close(self) -> None:
        """Stop the child (idempotent). Not under the lock: a call stuck in a child
        that does not answer ends when the child is killed."""
        self._closed = True
        _stop(self._process, self._conn)

    def __enter__(self) -> PRMProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, kind: str, payload: Any) -> Any:
        with self._lock:
            if self._closed:
                raise PRMError("the PRM process is gone: it was closed")
            if not self._process.is_alive():
                self._restart()
            try:
                answer, value = self._exchange(kind, payload)
            except PRMError:
                if kind != _SCORE or self._closed:
                    raise
                # The child died before it answered (a SIGKILL is not seen at once):
                # the check once more, on a new child (which scores it afresh). One
                # that dies again fails the call; the next call starts another.
                self._restart()
                answer, value = self._exchange(kind, payload)
        if answer == "error":
            raise _rebuild(value)
        return value

    def _exchange(self, kind: str, payload: Any) -> tuple[str, Any]:
        """Send one call down the pipe and read its answer (``PRMError`` if the child
        is gone)."""
        try:
            self._conn.send((kind, payload))
            return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, BrokenPipeError, OSError) as exc:
            self._process.join(timeout=10)  # dead, or dying: its exit code, for the message
            raise PRMError(
                f"the PRM process is gone ({type(exc).__name__}, exit code "
                f"{self._process.exitcode}); it is started again at the next call"
            ) from None

    def _restart(self) -> None:
        """Start a dead child again (under the lock), or say why not (``PRMError``)."""
        if time.monotonic() < self._retry_at:
            raise PRMError(
                f"the PRM process is gone and could not start again: {self._restart_error}"
            )
        code = self._process.exitcode
        _log.warning("the PRM process exited (exit code %s): starting it again", code)
        _stop(self._process, self._conn)
        try:
            self._process, self._conn = self._start()
            if self._closed:  # closed meanwhile, from another thread
                _stop(self._process, self._conn)
                raise PRMError("the PRM process is gone: it was closed")
        except Exception as exc:
            self._retry_at = time.monotonic() + RESTART_BACKOFF
            self._restart_error = f"{type(exc).__name__}: {exc}"
            raise PRMError(
                f"the PRM process exited (exit code {code}) and could not start again: "
                f"{self._restart_error}"
            ) from None
        _log.warning("the PRM process is serving again")


def _stop(process: Any, conn: Any) -> None:
    """Stop a child: ask it to close, kill it if it does not within 10 s."""
    if process.is_alive():
        try:
            conn.send((_CLOSE, None))
        except (BrokenPipeError, OSError):
            pass
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
    else:
        process.join()  # reaped: no zombie left behind
    conn.close()


class PRMPool:
    """``workers`` ``PRMProcess`` es built by ``factory``, scoring side by side (see the
    module docstring). Started together; if one fails to start, the others stop."""

    def __init__(
        self, factory: Callable[[], PRM], workers: int, *, start_timeout: float = 600.0
    ) -> None:
        if not (isinstance(workers, int) and workers >= 1):
            raise ConfigError(f"workers={workers!r} must be an int >= 1")
        self._calls = concurrent.futures.ThreadPoolExecutor(workers, "sart-prm-pool")
        starts = [
            self._calls.submit(PRMProcess, factory, start_timeout=start_timeout)
            for _ in range(workers)
        ]
        self._processes: list[PRMProcess] = []
        errors: list[BaseException] = []
        for start in starts:
            try:
                self._processes.append(start.result())
            except BaseException as exc:  # re-raised below, once the others are closed
                errors.append(exc)
        if errors:
            self.close()
            raise errors[0]
        self.placement = Placement(workers, cooldown=0.0)
        """Which process scores each request (``sart.prm.placement``)."""

    @property
    def workers(self) -> int:
        """Processes scoring side by side: the driver keeps that many checks in flight."""
        return len(self._processes)

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        """Each item scored by its request's process, all processes at once. A process
        that fails fails its requests' items (``PRMError`` naming them)."""
        items = list(items)
        out = fan_out(
            self.placement,
            self._calls,
            [item.branch.request_id for item in items],
            lambda worker, held: self._processes[worker].score([items[k] for k in held]),
        )
        # An unattributed error as from a PRM in this process: the driver retries
        # request by request to find the one at fault.
        out.raise_failures()
        rewards: list[float] = [0.0] * len(items)
        for worker, values in out.answers.items():
            for k, value in zip(out.held[worker], values):
                rewards[k] = value
        return rewards

    def release(self, request_id: str) -> None:
        """Forget the request; its process drops its caches in the background (a call
        from the driver's loop must not wait for a check that process is scoring)."""
        worker = self.placement.release(request_id)
        if worker is not None:
            self._calls.submit(self._processes[worker].release, request_id)

    def close(self) -> None:
        for process in self._processes:
            process.close()
        self._calls.shutdown(wait=True)

    def __enter__(self) -> PRMPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
