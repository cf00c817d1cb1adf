"""The exception tree of sart, in one place.

::

    SartError                      base of everything sart raises on purpose
    ├── ConfigError (ValueError)   a setting is out of range; the message names field and value
    ├── UnknownComponentError (ConfigError, LookupError)
    │                              an engine/PRM name that is not registered
    ├── MissingDependencyError (ImportError)
    │                              an optional extra (``sart[hf]``...) is not installed
    ├── EngineError                an engine call failed; ``request_ids`` names the requests
    │                              it affects (empty: unknown, so every request in flight)
    ├── PRMError                   a PRM call failed or returned an unusable reward
    └── SchedulerError             the scheduler was driven out of protocol (a driver bug)

Engine and PRM errors never escape the driver: they fail the affected requests,
which end with ``RequestStatus.FAILED`` and the reason, and the rest carry on.
``AssertionError`` is the exception: it means a bug (the fake engine raises
``EngineMisuse`` on protocol violations), and the driver lets it through.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import TypeVar


class SartError(Exception):
    """Base class of every error sart raises on purpose."""


class ConfigError(SartError, ValueError):
    """A configuration value is invalid. The message names the field and the value."""


class UnknownComponentError(ConfigError, LookupError):
    """A component name (engine, PRM) is not in the registry."""


class MissingDependencyError(SartError, ImportError):
    """An optional dependency is missing; the message says which extra to install."""


#: Top-level modules of the optional extras -> the extra that installs them.
EXTRAS = {
    "torch": "hf",
    "transformers": "hf",
    "tokenizers": "hf",
    "vllm": "vllm",
    "sglang": "sglang",
    "rich": "bench",
    "matplotlib": "bench",
    "httpx": "remote",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
}


class _AttributedError(SartError):
    """An error that may name the requests it affects."""

    def __init__(self, message: str, request_ids: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.request_ids: frozenset[str] = frozenset(request_ids)


class EngineError(_AttributedError):
    """An engine call failed.

    ``request_ids`` names the requests the failure is confined to. An engine
    that raises with ``request_ids`` promises the call had no effect on other
    requests, so the driver fails those requests and retries the rest. Without
    ``request_ids`` every request involved in the call is failed.
    """


class PRMError(_AttributedError):
    """A PRM call failed, or returned a reward outside [0, 1] or NaN."""


class SchedulerError(SartError):
    """The scheduler was fed events that do not answer its commands (a driver bug)."""


def config_check(ok: bool, field: str, value: object, rule: str) -> None:
    """Raise ``ConfigError("field=value must be rule")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}={value!r} must be {rule}")


E = TypeVar("E", bound=enum.Enum)


def enum_converter(kind: type[E], field: str) -> Callable[[object], E]:
    """An attrs converter to ``kind`` that names ``field`` and the choices on a bad value."""

    def convert(value: object) -> E:
        try:
            return kind(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in kind)
            raise ConfigError(f"{field}={value!r} must be one of {choices}") from None

    return convert
