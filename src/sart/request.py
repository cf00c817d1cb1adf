"""``Request``: what a user submits."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import attrs

from sart.errors import ConfigError, config_check, number_above
from sart.policies.base import Policy
from sart.types import Prompt, SamplingSettings, default_seed


def _check_id(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    config_check(isinstance(value, str) and value != "", "id", value, "a non-empty str")


def _check_prompt(_inst: object, _attr: attrs.Attribute, value: Prompt) -> None:
    # Empty is refused as vLLM refuses it: no token to prefill, nothing to branch from.
    if isinstance(value, str) and value:
        return
    if isinstance(value, tuple) and value and all(isinstance(t, int) for t in value):
        return
    raise ConfigError(f"prompt={value!r} must be a non-empty str or tuple of token ids")


def _to_prompt(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _check_policy(_inst: object, _attr: attrs.Attribute, value: Policy) -> None:
    if not isinstance(value, Policy):
        raise ConfigError(f"policy={value!r} must be a sart.Policy (e.g. sart.sart(8))")


def _check_priority(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"priority={value!r} must be an int (lower is more urgent)")


def _to_float(value: object) -> object:
    """A number (numpy's too) as a float; anything else as it is, for the validator to
    name."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def _check_arrival(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    config_check(
        isinstance(value, float) and math.isfinite(value) and value >= 0,
        "arrival",
        value,
        "a finite number >= 0",
    )


def _to_sampling(value: object) -> object:
    """A mapping of ``SamplingSettings``' fields (``{"max_tokens": 512}``) as one."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {a.name for a in attrs.fields(SamplingSettings)})
        if unknown:
            raise ConfigError(
                f"sampling={dict(value)!r}: SamplingSettings has no field {unknown[0]!r}"
            )
        return SamplingSettings(**value)
    return value


def _check_sampling(_inst: object, _attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, SamplingSettings):
        raise ConfigError(
            f"sampling={value!r} must be a sart.SamplingSettings (or a dict of its fields)"
        )


def _check_keep_logprobs(inst: Request, _attr: attrs.Attribute, value: bool) -> None:
    config_check(isinstance(value, bool), "keep_logprobs", value, "a bool")
    if value and inst.sampling.logprobs is None:
        raise ConfigError(
            "keep_logprobs=True needs sampling.logprobs (0 for the sampled tokens' only, "
            "k for the k most likely tokens' too)"
        )


@attrs.frozen
class Request:
    """One reasoning request: a prompt, the policy that serves it, how to sample."""

    id: str = attrs.field(validator=_check_id)
    """Unique among the requests of a run."""
    prompt: Prompt = attrs.field(converter=_to_prompt, validator=_check_prompt)
    """Text, or token ids (a list is converted to a tuple)."""
    policy: Policy = attrs.field(validator=_check_policy)
    """The strategy: ``sart.sart(8)``, ``sart.self_consistency(4)``, ``sart.vanilla()``..."""
    sampling: SamplingSettings = attrs.field(
        factory=SamplingSettings, converter=_to_sampling, validator=_check_sampling
    )
    """Sampling settings shared by all branches (each branch gets its own seed); a dict
    of their fields is taken as one."""
    arrival: float = attrs.field(default=0.0, converter=_to_float, validator=_check_arrival)
    """When the request arrives, in the clock's unit (seconds on the wall clock)."""
    priority: int = attrs.field(default=0, validator=_check_priority)
    """Lower is more urgent (vLLM's convention): waiting requests and branches are
    admitted by priority, then in arrival order. One priority for every request is
    first come, first served (Algorithm 1)."""
    timeout: float | None = attrs.field(default=None, validator=number_above(0, optional=True))
    """The most time it may take, from its arrival, in the clock's unit: a request not
    finished by its deadline, ``arrival + timeout``, is cancelled there (waiting or
    running; ``RequestStatus.CANCELLED``, its branches aborted), checked at every
    driver step. ``None``: no deadline."""
    keep_logprobs: bool = attrs.field(default=False, validator=_check_keep_logprobs)
    """Keep the log-probabilities ``sampling.logprobs`` asks for, every token of every
    branch, and return the chosen branch's as ``RequestResult.logprobs`` (what ``sart
    serve`` answers a request's ``logprobs`` with). They are held while the request
    runs: about 150 bytes per token of every branch, and 75 more per most likely token
    (measured: 0.6 KB a token with 5, 1.7 KB with 20)."""

    @property
    def deadline(self) -> float | None:
        """``arrival + timeout``: when it is cancelled if it has not finished."""
        return None if self.timeout is None else self.arrival + self.timeout

    @property
    def seed(self) -> int:
        """The base seed: branch ``j`` samples with ``seed + j``."""
        return self.sampling.seed if self.sampling.seed is not None else default_seed(self.id)
