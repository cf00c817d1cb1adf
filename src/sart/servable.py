"""Whether a driver's engine and PRM can serve a request: refused at once
(``ConfigError``) rather than failed once it runs."""

from __future__ import annotations

from sart.engines.base import engine_name, sampling_fields, supports_fork, unhonoured_sampling
from sart.errors import ConfigError
from sart.policies.base import Policy
from sart.prm.base import PRM
from sart.request import Request


def check_servable(
    request: Request,
    prm: PRM | None,
    engine: object,
    *,
    no_prm: str = "the driver has no PRM (prm=None): pass one to it",
) -> None:
    """Refuse (``ConfigError``) a request that ``prm`` and ``engine`` cannot run: its
    policy needs PRM rewards and ``prm`` is ``None``, its sampling sets a field the
    engine does not honour (``sampling_fields``), or it forks branches and the
    engine cannot fork. ``no_prm`` ends the first message: what the caller (the
    driver, a server) lacks and how to give it one."""
    policy = request.policy
    if prm is None and (policy.scores_running or policy.scores_completed):
        raise ConfigError(
            f"request {request.id!r} uses policy {policy.name!r}, which needs PRM rewards "
            f"({_readers(policy)}); {no_prm}"
        )
    unhonoured = unhonoured_sampling(engine, request.sampling)
    if unhonoured:
        field, value = next(iter(unhonoured.items()))
        raise ConfigError(
            f"{field}={value!r} is not honoured by {engine_name(engine)} (request "
            f"{request.id!r}): it honours {sorted(sampling_fields(engine)) or 'none'} of "
            "vLLM's extra sampling fields"
        )
    if policy.forks and not supports_fork(engine):
        raise ConfigError(
            f"request {request.id!r} uses policy {policy.name!r}, which forks branches; "
            f"{type(engine).__name__} does not support forking"
        )


def _readers(policy: Policy) -> str:
    """The parts of ``policy`` that read rewards, for a user whose own part may say
    ``needs_rewards = True`` only by default."""
    parts = [
        (role, part)
        for role, part in (
            ("prune rule", policy.prune),
            ("re-branching rule", policy.rebranch),
            ("stop rule", policy.stop),
            ("selector", policy.select),
        )
        if getattr(part, "active", True) and part.needs_rewards
    ]
    named = ", ".join(f"its {role} {type(part).__name__}" for role, part in parts)
    said = f"{named} {'reads' if len(parts) == 1 else 'read'} them"
    if any(not type(part).__module__.startswith("sart.") for _, part in parts):
        # A user's part reads rewards by default: it may just not have said otherwise.
        said += "; a part of yours that does not sets needs_rewards = False"
    return said
