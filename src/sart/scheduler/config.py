"""The scheduler's settings (``SchedulerConfig``) and its counters (``SchedulerStats``)."""

from __future__ import annotations

import attrs

from sart.errors import ConfigError, enum_converter, int_at_least
from sart.types import Admission, Scoring


def _positive_or_none(_inst: object, attr: attrs.Attribute, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"{attr.name}={value!r} must be None or > 0")


def to_admission(value: object) -> Admission:
    """An attrs converter to ``Admission`` (``ConfigError`` naming the choices)."""
    return enum_converter(Admission, "admission")(value)


def to_scoring(value: object) -> Scoring:
    """An attrs converter to ``Scoring`` (``ConfigError`` naming the choices)."""
    return enum_converter(Scoring, "scoring")(value)


@attrs.frozen
class SchedulerConfig:
    """Settings of the scheduler (per-request settings live in each request's ``Policy``)."""

    batch_size: int = attrs.field(validator=int_at_least(1))
    """``B``: the most branches decoding at once."""
    admission: Admission = attrs.field(default=Admission.CHUNK, converter=to_admission)
    """When freed slots are refilled: between chunks (Algorithm 1) or at the next step."""
    scoring: Scoring = attrs.field(default=Scoring.OVERLAPPED, converter=to_scoring)
    """Whether decoding waits for PRM checks (Algorithm 1 as written) or goes on meanwhile."""
    poll_steps: int | None = attrs.field(default=None, validator=int_at_least(1, optional=True))
    """With overlapped scoring, the longest decode chunk while a ``Score`` is in flight;
    ``None``: an eighth of the shortest interval among running requests."""
    max_scores: int = attrs.field(default=1, validator=int_at_least(1))
    """With overlapped scoring, the most ``Score`` commands in flight at once (``K``:
    as many as the PRM has workers -- processes, servers, replicas -- to score them
    side by side). Blocking scoring (Algorithm 1) scores one check batch at a time:
    it takes only 1."""
    aging: float | None = attrs.field(default=None, validator=_positive_or_none)
    """With several priorities: every waiting request gains one level of urgency per
    ``aging`` time units it has waited since its arrival, so that none waits for
    ever behind a stream of more urgent ones: a request ``d`` levels less urgent
    than others goes before every one of them that arrived more than
    ``d * aging`` after it (so it waits only for those that came before that).
    ``None``: strict priorities (a steady stream of urgent requests can starve the
    others)."""
    pause: bool = False
    """With several priorities: when more urgent work waits and the budget is full,
    pause running branches of less urgent requests (``Pause``: the engine frees their
    KV and keeps their tokens) and resume them later, from those tokens, when they
    are the most urgent waiting work. Never more branches than the more urgent
    waiting work can take, never a request's last running branch; which ones, its
    policy's ``PauseRule`` says. Needs an engine that can (``supports_pause``): the
    drivers turn it on for one."""

    def __attrs_post_init__(self) -> None:
        if self.scoring is Scoring.BLOCKING and self.max_scores != 1:
            raise ConfigError(
                f"max_scores={self.max_scores} must be 1 with scoring='blocking' (Algorithm 1 "
                "waits for each check before anything else runs)"
            )


@attrs.frozen
class SchedulerStats:
    """A snapshot of the scheduler's queues and counters."""

    step: int
    """Decode steps run so far."""
    queued_requests: int
    queued_branches: int
    running_branches: int
    active_requests: int
    """Prefilled and not finished."""
    finished_requests: int
    failed_cleanups: int
    """Abort/release commands the engine failed to carry out."""
    paused_branches: int = 0
    """Branches paused for more urgent work (``SchedulerConfig.pause``), over the run."""
