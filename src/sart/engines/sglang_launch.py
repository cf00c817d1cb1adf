"""Starting ``sglang.Engine`` in sart's process without letting it take the process over.

Three things SGLang (0.5.23) does at start-up that a library's caller would not
expect, and what is done about each:

- A child process (the scheduler) that fails to start sends the parent SIGQUIT,
  and SGLang's handler kills the whole process tree, sart's process included
  (the shell says ``Killed``). Here the handler (``custom_sigquit_handler``, a
  ``ServerArgs`` field) raises instead: the children the start left are killed
  and the caller gets a ``ConfigError`` (the child's own error is printed above
  it). Once the engine is up, a failing child stops the process as SGLang's
  handler would, after saying so.
- ``logging.basicConfig(force=True)`` at ERROR replaces the root logger's
  handlers and level, silencing every warning sart logs afterwards (an ignored
  request field, a failed request's reason): both are put back.
- A value SGLang refuses in this process (``ValueError``, ``TypeError``), or a
  scheduler that died before it was ready (``RuntimeError``), is a
  ``ConfigError`` saying so, not a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from sart.engines.sglang_args import checked_server_args
from sart.errors import ConfigError

_log = logging.getLogger(__name__)


class _ChildFailed(Exception):
    """SGLang's SIGQUIT: one of its child processes failed."""


def start_engine(sglang: Any, model_path: str, server_args: dict[str, Any]) -> Any:
    """``sglang.Engine(model_path=model_path, **server_args)``, checked and started as
    the module docstring says."""
    args_class = getattr(sglang.Engine, "server_args_class", None)
    if args_class is None:  # releases before the Engine named its class
        args_class = importlib.import_module("sglang.srt.server_args").ServerArgs
    args = checked_server_args(args_class, server_args)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGQUIT) if main else None
    if main:  # SGLang installs a signal handler only from the main thread
        args["custom_sigquit_handler"] = _raise_child_failed
    before = _children()
    try:
        with _root_logger_kept():
            engine = sglang.Engine(model_path=model_path, **args)
    except _ChildFailed:
        _failed_start(before, main, previous)
        raise ConfigError(
            "SGLang's engine did not start: a child process failed (SGLang printed why "
            "above); check the settings given to it (--sglang-arg)"
        ) from None
    except (ValueError, TypeError, RuntimeError) as exc:  # RuntimeError: a scheduler died
        _failed_start(before, main, previous)
        raise ConfigError(f"SGLang could not start its engine from these settings: {exc}") from exc
    if main and signal.getsignal(signal.SIGQUIT) is _raise_child_failed:  # SGLang set it
        signal.signal(signal.SIGQUIT, _stop_on_child_failure)
    return engine


def _failed_start(before: set[Any], main: bool, previous: Any) -> None:
    """After a start that failed: its children killed, SIGQUIT's handler as it was.

    Another failing child may send its SIGQUIT meanwhile: ignored while they are
    killed (raised in the middle of the cleanup, it escaped as a bare traceback: seen
    once in CI, ``--sglang-arg tp_size=2``)."""
    if main:
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    try:
        _kill(_children() - before)
    finally:
        if main:
            signal.signal(signal.SIGQUIT, previous)


def _raise_child_failed(signum: int, frame: FrameType | None) -> None:
    raise _ChildFailed


def _stop_on_child_failure(signum: int, frame: FrameType | None) -> None:
    # What SGLang's own handler does once the engine serves: nothing can go on.
    _log.error("an SGLang child process failed: stopping, as SGLang does")
    _kill(_children())
    os._exit(1)


@contextlib.contextmanager
def _root_logger_kept() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _children() -> set[Any]:
    """This process's child processes (psutil's, which SGLang requires)."""
    try:
        import psutil
    except ImportError:
        return set()
    return set(psutil.Process().children(recursive=True))


def _kill(processes: set[Any]) -> None:
    if not processes:
        return
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(list(processes), timeout=10)  # gone (and reaped) before we go on
