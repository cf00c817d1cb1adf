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
isolates request by request, as it does for a PRM in the same process. A
child that died fails every later call with ``PRMError``. ``close()`` (or
leaving the ``with`` block) stops the child; it is a daemon, so it never
outlives the parent.

``PRMPool(factory, workers=K)`` hosts ``K`` such processes and scores on them
side by side: a request's items always go to one process (its cache is there;
``sart.prm.placement``), one ``score`` call sends each process the items it
holds, at once, and ``workers`` tells the driver to keep ``K`` checks in flight.
A process that fails (or died) fails only the requests it held.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sart.errors import ConfigError, PRMError
from sart.prm.base import PRM, ScoreItem
from sart.prm.placement import Placement, fan_out

_SCORE, _RELEASE, _CLOSE = "score", "release", "close"


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
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, factory), name="sart-prm", daemon=True
        )
        self._process.start()
        child.close()
        self._lock = threading.Lock()  # one call on the pipe at a time
        if not self._conn.poll(start_timeout):
            self.close()
            raise PRMError(f"the PRM process did not start within {start_timeout} s")
        try:
            kind, payload = self._recv()
        except EOFError:
            self.close()
            raise PRMError(
                f"the PRM process exited before it was ready (exit code {self._process.exitcode})"
            ) from None
        if kind == "error":
            self.close()
            raise _rebuild(payload)

    def score(self, items: Sequence[ScoreItem]) -> list[float]:
        return self._call(_SCORE, list(items))

    def release(self, request_id: str) -> None:
        self._call(_RELEASE, request_id)

    def close(self) -> None:
        """Stop the child (idempotent)."""
        if self._process.is_alive():
            try:
                self._conn.send((_CLOSE, None))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()

    def __enter__(self) -> PRMProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, kind: str, payload: Any) -> Any:
        with self._lock:
            try:
                self._conn.send((kind, payload))
                answer, value = self._recv()
            except (EOFError, BrokenPipeError, OSError) as exc:
                raise PRMError(f"the PRM process is gone ({type(exc).__name__})") from None
        if answer == "error":
            raise _rebuild(value)
        return value

    def _recv(self) -> tuple[str, Any]:
        return self._conn.recv()  # type: ignore[no-any-return]


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
