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

    EngineMisuse (AssertionError)  an engine driven out of its contract (a bug of sart's)

Engine and PRM errors never escape the driver: they fail the affected requests,
which end with ``RequestStatus.FAILED`` and the reason, and the rest carry on;
so does any other exception an engine or a PRM raises, ``AssertionError``
included (a PRM's shape check). ``EngineMisuse`` (an ``AssertionError`` the
fake engine raises when it is driven out of protocol) is the exception: it
means a bug of sart's, and the driver lets it through.

The helpers below raise them the same way everywhere: ``config_check``,
``int_at_least`` and ``enum_converter`` for settings, ``needs_extra`` around
imports from an optional extra.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # hints only: the error tree imports nothing at run time
    import attrs


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
    "math_verify": "eval",
    "datasets": "eval",
}


def install_hint(*extras: str) -> str:
    """The command that installs an extra from a checkout of sart (alternatives joined
    by "or"): ``pip install -e '.[hf]' in a checkout of sart``."""
    commands = " or ".join(f"pip install -e '.[{extra}]'" for extra in extras)
    return f"{commands} in a checkout of sart"


@contextlib.contextmanager
def needs_extra(what: str, *extras: str) -> Iterator[None]:
    """Around imports from an optional extra: an ``ImportError`` in the block becomes
    ``MissingDependencyError`` saying that ``what`` needs the missing module and the
    ``install_hint`` of ``extras``, with the import's own message (a version mismatch
    shows there)."""
    try:
        yield
    except MissingDependencyError:
        raise  # a nested guard already said what to install
    except ImportError as exc:
        raise MissingDependencyError(
            f"{what} needs {exc.name or 'an optional module'}: {install_hint(*extras)} "
            f"(importing it failed with: {exc})"
        ) from exc


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


class RequestRefused(EngineError):
    """The engine refuses a request for what it asks, not for a fault of its own (its
    prompt does not fit the model's context): the request fails with the reason, and
    a server answers it 400, as vLLM's does, naming ``field`` (the request field at
    fault, where the engine knows it: ``"prompt"``, ``"logprobs"``)."""

    def __init__(
        self, message: str, request_ids: Iterable[str] = (), field: str | None = None
    ) -> None:
        super().__init__(message, request_ids)
        self.field = field


class PRMError(_AttributedError):
    """A PRM call failed, or returned a reward outside [0, 1] or NaN."""


class EngineMisuse(AssertionError):
    """The engine contract was violated (a bug in the caller, not a request failure):
    the fake engine and the ledger raise it, and the driver lets it through."""


class SchedulerError(SartError):
    """The scheduler was fed events that do not answer its commands (a driver bug)."""


def config_check(ok: bool, field: str, value: object, rule: str) -> None:
    """Raise ``ConfigError("field=value must be rule")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}={value!r} must be {rule}")


def int_at_least(
    low: int, *, optional: bool = False, rule: str | None = None
) -> Callable[[object, attrs.Attribute, object], None]:
    """An attrs validator: the value is an int ``>= low`` (or ``None`` if ``optional``),
    else ``ConfigError("field=value must be rule")``, the field named by attrs.
    ``rule`` defaults to ``">= low"`` (``"None or an int >= low"`` if ``optional``)."""
    rule = rule or (f"None or an int >= {low}" if optional else f">= {low}")

    def check(_inst: object, attr: attrs.Attribute, value: object) -> None:
        ok = (optional and value is None) or (
            # True is an int to Python, not a count to a user.
            isinstance(value, int) and not isinstance(value, bool) and value >= low
        )
        config_check(ok, attr.name, value, rule)

    return check


def finite_number(value: object) -> bool:
    """Whether ``value`` is a finite int or float (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def number_above(
    low: float, *, optional: bool = False
) -> Callable[[object, attrs.Attribute, object], None]:
    """An attrs validator: the value is a finite number (an int or a float, not a bool)
    ``> low`` (or ``None`` if ``optional``), else ``ConfigError("field=value must be
    None or a finite number > low")``, the field named by attrs."""
    rule = f"{'None or ' if optional else ''}a finite number > {low:g}"

    def check(_inst: object, attr: attrs.Attribute, value: object) -> None:
        number = finite_number(value) and value > low  # type: ignore[operator]
        config_check(number or (optional and value is None), attr.name, value, rule)

    return check


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
