"""What a server fixes at start: ``ServeConfig`` (names, defaults, limits, access) and
``Backend`` (the engine and PRM it serves).

Everything a request may change (method, branches, sampling) has a default
and, where it costs the server, a limit here. Nothing here can be changed by
a request: models, PRMs and methods are fixed when the server starts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from sart import converters
from sart.errors import config_check, finite_number, int_at_least, number_above
from sart.policies.equivalence import Equivalence, check_equivalence
from sart.prm.base import PRM
from sart.scheduler.config import to_admission, to_scoring
from sart.types import (
    EXTRA_SAMPLING,
    Admission,
    SamplingSettings,
    Scoring,
    check_temperature,
    check_top_p,
)

_positive_int = int_at_least(1, rule="an int >= 1")


def _check_models(_inst: object, _attr: attrs.Attribute, value: tuple[str, ...]) -> None:
    config_check(
        bool(value) and all(isinstance(v, str) and v for v in value),
        "models",
        value,
        "one or more non-empty names",
    )


def _check_keepalive(_inst: object, _attr: attrs.Attribute, value: float | None) -> None:
    config_check(
        value is None or (finite_number(value) and value > 0),
        "keepalive",
        value,
        "None or a number of seconds > 0",
    )


def _check_shutdown_grace(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    config_check(
        finite_number(value) and value >= 0, "shutdown_grace", value, "a number of seconds >= 0"
    )


def _check_api_key(_inst: object, _attr: attrs.Attribute, value: str | None) -> None:
    # The key itself never appears in a message.
    config_check(
        value is None or (isinstance(value, str) and value != ""),
        "api_key",
        "...",
        "a non-empty str or None",
    )


def _check_sampling(_inst: object, _attr: attrs.Attribute, value: dict[str, Any]) -> None:
    config_check(
        isinstance(value, dict) and set(value) <= set(EXTRA_SAMPLING),
        "sampling",
        value,
        f"a dict of {', '.join(EXTRA_SAMPLING)}",
    )
    SamplingSettings(**value)  # each value checked as a request's is


@attrs.frozen
class ServeConfig:
    """A server's fixed settings: served model names, per-request defaults and limits,
    the scheduler's settings, and access control."""

    models: tuple[str, ...] = attrs.field(converter=converters.strs, validator=_check_models)
    """Names the server answers to in ``model`` (the first one is listed first)."""
    root: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    """What the names serve, as ``vllm serve``'s ``/v1/models`` says it in ``root``: the
    model's directory or hub id (a gateway: its upstreams' model); ``None``: the name."""
    method: str = "sart"
    """The method of requests that name none (``sart.serve.method_names()``); checked
    when the app is built (``create_app``): a plugin may register it after this is made."""
    n: int = attrs.field(default=8, validator=_positive_int)
    """Branches of requests that do not say (methods with one branch ignore it)."""
    max_n: int = attrs.field(default=32, validator=_positive_int)
    """The most branches one request may ask for."""
    max_logprobs: int = attrs.field(default=20, validator=int_at_least(0, rule="an int >= 0"))
    """The most likely tokens' log-probabilities a request may ask for with each token
    (vLLM's ``--max-logprobs``, its default)."""
    interval: int = attrs.field(default=400, validator=_positive_int)
    """``T``, decode steps between checks, for requests that do not say."""
    max_tokens: int = attrs.field(default=16384, validator=_positive_int)
    """Tokens per branch for requests that do not say."""
    max_tokens_limit: int = attrs.field(
        default=attrs.Factory(lambda self: self.max_tokens, takes_self=True),
        validator=_positive_int,
    )
    """The most tokens per branch a request may ask for (default: ``max_tokens``)."""
    temperature: float = attrs.field(
        default=attrs.fields(SamplingSettings).temperature.default, validator=check_temperature
    )
    """Sampling temperature of requests that do not say (``SamplingSettings``')."""
    top_p: float = attrs.field(
        default=attrs.fields(SamplingSettings).top_p.default, validator=check_top_p
    )
    """Nucleus mass of requests that do not say (``SamplingSettings``')."""
    sampling: dict[str, Any] = attrs.field(factory=dict, validator=_check_sampling)
    """Defaults of ``EXTRA_SAMPLING`` fields (``top_k``, ``min_p``, the penalties) for
    requests that do not set them, by vLLM's name: a model's ``generation_config.json``
    gives them (``sart.generation_config``); unset: the engine's neutral values."""
    batch_size: int = attrs.field(default=64, validator=_positive_int)
    """``B``: the most branches decoding at once, over all requests."""
    scoring: Scoring = attrs.field(default=Scoring.OVERLAPPED, converter=to_scoring)
    """Whether decoding goes on while the PRM scores (see ``sart.Scoring``)."""
    admission: Admission = attrs.field(default=Admission.CHUNK, converter=to_admission)
    """When freed batch slots are refilled (see ``sart.Admission``)."""
    max_queue: int = attrs.field(default=1024, validator=_positive_int)
    """The most requests waiting to be scheduled; past it a request gets 429 at once."""
    aging: float | None = attrs.field(default=60.0, validator=number_above(0, optional=True))
    """Seconds of waiting that make a request one ``priority`` level more urgent (see
    ``sart.SchedulerConfig.aging``); ``None``: strict priorities."""
    api_key: str | None = attrs.field(default=None, repr=False, validator=_check_api_key)
    """Bearer key that ``/v1/*`` requests must carry (``None``: open)."""
    max_body_bytes: int = attrs.field(default=1 << 20, validator=_positive_int)
    """Largest request body accepted (413 past it)."""
    keepalive: float | None = attrs.field(default=None, validator=_check_keepalive)
    """Seconds between SSE keep-alive comments while a streamed request is undecided
    (``None``: none, as vLLM's server sends none). For proxies that close idle
    connections; vLLM's ``vllm bench serve`` client loses the event after a comment
    that arrives alone (it strips each read, comment terminator included)."""
    stream_interval: int = attrs.field(default=1, validator=_positive_int)
    """Tokens per streamed chunk of a request whose one branch is its answer
    (``vanilla``), after its first token, as vLLM's ``--stream-interval``; other
    streams send the chosen answer in one chunk (``sart.serve.events``)."""
    shutdown_grace: float = attrs.field(default=5.0, validator=_check_shutdown_grace)
    """Seconds the requests in flight when the server is told to stop (SIGTERM, Ctrl-C)
    get to finish; those still running then are cancelled and answered 503 (an error
    event when streaming), before the connections close (``Service.drain``)."""
    equivalence: Equivalence | None = attrs.field(
        default=None, validator=attrs.validators.optional(check_equivalence)
    )
    """How votes and agreement stops group answers (``None``: each method's own, exact
    strings); ``sart.eval.MathVerifyEquivalence`` for a math model (``--equivalence
    math-verify``)."""

    def __attrs_post_init__(self) -> None:
        config_check(self.n <= self.max_n, "n", self.n, f"<= max_n={self.max_n}")
        config_check(
            self.max_tokens <= self.max_tokens_limit,
            "max_tokens",
            self.max_tokens,
            f"<= max_tokens_limit={self.max_tokens_limit}",
        )


@attrs.frozen
class Backend:
    """What a server serves, fixed for its life: the engine (any sart engine, sync or
    async), the PRM (``None``: only methods that need no rewards), and what to call
    when the server stops."""

    engine: Any
    prm: PRM | None = None
    close: Callable[[], Awaitable[None] | None] | None = None
    """Called (and awaited, if it returns an awaitable) on the server's loop as it stops."""
