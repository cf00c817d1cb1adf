"""math-verify's ``parse`` and ``verify``, bounded in time and callable from any thread.

math-verify (``pip install -e '.[eval]'``) bounds each parse and each
comparison with ``signal.alarm``, which works only in the main thread: off it,
``parse`` and ``verify`` raise ``ValueError``, and with their timeouts turned
off (``parsing_timeout=None``, ``timeout_seconds=None``) nothing bounds a
pathological sympy simplification at all. ``MathVerify`` therefore runs a
call where it can be bounded:

- **in the main thread**, in process, with math-verify's own alarms
  (``parsing_timeout`` and ``timeout_seconds`` set to ``timeout``): no
  overhead beyond math-verify's own;
- **from any other thread**, in a worker process (``multiprocessing``, spawn
  start method, started on first use). The call runs in that process's main
  thread, where math-verify's alarms work, and the calling thread waits with
  a deadline of ``6 * timeout + 10`` seconds. A worker that misses it (a
  computation stuck in C code, which no alarm interrupts) is killed and
  replaced; the call counts as *not equal*, and calls of other threads that
  were waiting on the killed worker are resubmitted to the new one.

Why a process and not a thread with a deadline: Python cannot stop a
thread, so a runaway comparison would keep a core (and a share of the
interpreter lock) busy after its caller gave up. The process costs a spawn
and the import of sympy and math-verify once (about a second), then a
round trip of inter-process communication per call; see
``docs/how-to/grading.md`` for measured numbers.

A timed-out parse or comparison counts as not equal, so on a slow machine
two runs may group or grade a pathological answer differently; every other
answer is graded deterministically.

Importing this module imports neither math-verify nor sympy.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.pool
import threading
import time
import weakref
from typing import Any

import attrs

from sart.errors import config_check, int_at_least, needs_extra

#: Seconds a worker may take beyond its own alarms, before it is killed.
_SLACK = 10.0
#: How often a waiting caller checks whether another caller restarted the worker.
_POLL = 0.25


def boxed(answer: str) -> str:
    """``answer`` in ``\\boxed{...}``, the form math-verify parses most reliably
    (a bare ``\\left( 3, \\frac{\\pi}{2} \\right)`` would parse as ``3``).
    Text that already has a ``\\boxed{`` or ``$`` delimiter is returned as it is."""
    if "\\boxed{" in answer or "$" in answer.replace("\\$", ""):
        return answer
    return "\\boxed{" + answer + "}"


def require_math_verify() -> Any:
    with needs_extra("grading by mathematical equivalence", "eval"):
        import math_verify
    return math_verify


@functools.lru_cache(maxsize=8192)
def _parsed(text: str, timeout: int) -> tuple[Any, ...]:
    """math-verify's parse of ``text``, cached (parsing costs more than comparing)."""
    return tuple(require_math_verify().parse(text, parsing_timeout=timeout))


def verify_texts(gold: str, prediction: str, timeout: int) -> bool:
    """math-verify's ``verify(parse(gold), parse(prediction))``, gold first (it is not
    symmetric), with math-verify's alarms; call it only in a main thread."""
    gold_parsed = _parsed(gold, timeout)
    if not gold_parsed:
        return False
    return bool(
        require_math_verify().verify(
            list(gold_parsed), list(_parsed(prediction, timeout)), timeout_seconds=timeout
        )
    )


def _warm_up() -> None:
    """Worker initializer: pay the imports before the first deadline runs."""
    require_math_verify()


class CallTimedOut(Exception):
    """A call in the worker process missed its deadline; the worker was replaced."""


class _Worker:
    """A lazily spawned ``multiprocessing.Pool``, killed and replaced when a call
    misses its deadline. Safe to share between threads."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._lock = threading.Lock()
        self._pool: multiprocessing.pool.Pool | None = None
        self._generation = 0

    def call(self, fn: Any, args: tuple[Any, ...], deadline: float) -> Any:
        while True:
            pool, generation = self._current()
            try:
                pending = pool.apply_async(fn, args)
            except ValueError:  # another caller terminated this pool just now
                continue
            end = time.monotonic() + deadline
            while True:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    self._restart(generation)
                    raise CallTimedOut(f"{getattr(fn, '__name__', fn)} took over {deadline:g} s")
                try:
                    return pending.get(min(remaining, _POLL))
                except multiprocessing.TimeoutError:
                    if self._generation != generation:
                        break  # another caller killed the worker: resubmit to the new one

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool = None
                self._generation += 1

    def _current(self) -> tuple[multiprocessing.pool.Pool, int]:
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("spawn")
                self._pool = context.Pool(self.processes, initializer=_warm_up)
                # A grader dropped without close() takes its worker with it.
                weakref.finalize(self, self._pool.terminate)
            return self._pool, self._generation

    def _restart(self, generation: int) -> None:
        with self._lock:
            if self._generation == generation and self._pool is not None:
                self._pool.terminate()
                self._pool = None
                self._generation += 1

    def __getstate__(self) -> dict[str, Any]:
        return {"processes": self.processes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["processes"])  # type: ignore[misc]


def _check_timeout(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    # signal.alarm counts whole seconds.
    config_check(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        "timeout",
        value,
        "a whole number of seconds >= 1",
    )


@attrs.frozen
class MathVerify:
    """``verify(gold, prediction)`` on texts, bounded by ``timeout`` from any thread."""

    timeout: int = attrs.field(default=5, validator=_check_timeout)
    """Seconds for each parse and each comparison (math-verify's own unit: whole seconds)."""
    workers: int = attrs.field(default=1, validator=int_at_least(1))
    """Worker processes for calls made off the main thread."""
    _worker: _Worker = attrs.field(init=False, eq=False, repr=False)

    @_worker.default
    def _make_worker(self) -> _Worker:
        return _Worker(self.workers)

    @property
    def deadline(self) -> float:
        """Seconds a call off the main thread may take: two parses, up to four
        comparisons (each parse gives at most a sympy form and a string), and slack."""
        return 6 * self.timeout + _SLACK

    def verify(self, gold: str, prediction: str) -> bool:
        """Whether ``prediction`` is ``gold``, as math-verify judges texts: gold first.
        Both are parsed as math-verify's ``parse`` reads a text (put a bare answer
        in ``\\boxed{}``: see ``boxed``). A timeout counts as ``False``."""
        if threading.current_thread() is threading.main_thread():
            return verify_texts(gold, prediction, self.timeout)
        require_math_verify()  # a missing extra is reported here, not as a worker's failure
        try:
            return bool(
                self._worker.call(verify_texts, (gold, prediction, self.timeout), self.deadline)
            )
        except CallTimedOut:
            return False

    def close(self) -> None:
        """Stop the worker processes (a later call off the main thread starts new ones)."""
        self._worker.close()


@attrs.frozen
class UsesMathVerify:
    """What a grader or a vote's equivalence that asks math-verify is configured by:
    ``timeout`` and ``workers`` (``MathVerify``'s) and the ``MathVerify`` built from
    them, which ``close`` stops."""

    timeout: int = 5
    """Seconds for each parse and each comparison; a timeout counts as a mismatch."""
    workers: int = 1
    """Worker processes for calls made off the main thread."""
    _verifier: MathVerify = attrs.field(init=False, eq=False, repr=False)

    @_verifier.default
    def _make_verifier(self) -> MathVerify:
        return MathVerify(self.timeout, self.workers)

    def close(self) -> None:
        """Stop the worker processes, if any were started."""
        self._verifier.close()


__all__ = ["CallTimedOut", "MathVerify", "UsesMathVerify", "boxed", "verify_texts"]
