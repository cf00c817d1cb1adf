"""Small value types shared by every layer: ids, status enums, sampling settings."""

from __future__ import annotations

import enum
import math
import zlib
from typing import NamedTuple

import attrs

from sart.errors import config_check, int_at_least

#: A prompt is text, or token ids when the caller has tokenised it already.
Prompt = str | tuple[int, ...]


class BranchId(NamedTuple):
    """Identity of one branch: the request it belongs to and its index ``0..n-1``."""

    request_id: str
    index: int  # type: ignore[assignment]  # shadows tuple.index: the name is the API

    def __str__(self) -> str:
        # vLLM's convention for child requests of a parallel-sampling parent.
        return f"{self.index}_{self.request_id}"


class BranchStatus(enum.IntEnum):
    """Lifecycle of a branch, ordered so that ``status > RUNNING`` means "ended".

    ``FINISHED`` (the model stopped: EOS or a stop string) and ``TRUNCATED``
    (the ``max_tokens`` cap) are kept apart, as Gymnasium keeps ``terminated``
    and ``truncated`` apart; both count as *completed* responses.
    """

    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    TRUNCATED = 3
    PRUNED = 4
    STOPPED = 5
    FAILED = 6

    @property
    def is_ended(self) -> bool:
        return self > BranchStatus.RUNNING

    @property
    def is_completed(self) -> bool:
        """A completed branch produced a whole response (it can be selected)."""
        return self in (BranchStatus.FINISHED, BranchStatus.TRUNCATED)


class FinishReason(enum.Enum):
    """Why an engine ended a branch by itself."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # reached max_tokens


class Phase(enum.Enum):
    """The two pruning phases of the paper (section 3): explore until the first completion."""

    EXPLORE = "explore"
    EXPLOIT = "exploit"


class RequestStatus(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    """An engine, PRM or policy failure ended it (``RequestResult.reason`` says which)."""
    CANCELLED = "cancelled"
    """Its caller cancelled it (``Scheduler.cancel``, ``DriverBase.cancel``, or a
    cancelled ``AsyncDriver.generate``)."""


class Admission(enum.Enum):
    """When freed batch slots are refilled.

    ``CHUNK`` is Algorithm 1: slots are refilled only between decode chunks of
    ``T`` steps. ``TOKEN`` refills at the next decode step: a decode call
    returns as soon as any branch ends.
    """

    CHUNK = "chunk"
    TOKEN = "token"


class Scoring(enum.Enum):
    """How PRM checks interleave with decoding.

    ``BLOCKING`` is Algorithm 1 as written: after a decode chunk the scheduler
    waits for the PRM's rewards before anything else runs, so the policy model
    idles while the PRM works. ``OVERLAPPED`` keeps decoding while the PRM
    scores a snapshot of the due branches; the check (phase change, pruning,
    early stop) is applied to the branches' state when the rewards arrive.
    Checks that need no rewards (Self-Consistency's) run at once in both
    modes; with a virtual clock and a PRM that costs nothing the two modes
    serve every request alike (overlapped only reorders the checks of one
    step, those needing no rewards first).
    """

    BLOCKING = "blocking"
    OVERLAPPED = "overlapped"


def default_seed(request_id: str) -> int:
    """A stable per-request seed, so that branch ``j`` of two requests never shares
    its random stream (``seed + j`` with one global seed would make it do so)."""
    return zlib.crc32(request_id.encode("utf-8"))


def _check_temperature(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    config_check(math.isfinite(value) and value >= 0.0, "temperature", value, ">= 0")


def _check_top_p(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    config_check(0.0 < value <= 1.0, "top_p", value, "in (0, 1]")


@attrs.frozen
class SamplingSettings:
    """How each branch samples. Branch ``j`` of a request uses seed ``seed + j``."""

    temperature: float = attrs.field(default=0.6, validator=_check_temperature)
    """Sampling temperature; 0.6 is DeepSeek-R1's recommendation for reasoning."""
    top_p: float = attrs.field(default=0.95, validator=_check_top_p)
    """Nucleus sampling mass."""
    max_tokens: int = attrs.field(default=16384, validator=int_at_least(1))
    """Cap on generated tokens per branch; reaching it ends the branch as ``TRUNCATED``."""
    seed: int | None = attrs.field(default=None, validator=int_at_least(0, optional=True))
    """Base seed; ``None`` derives a stable one from the request id."""
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Stop strings; generating one ends the branch as ``FINISHED``."""
    logprobs: int | None = attrs.field(default=None, validator=int_at_least(0, optional=True))
    """Log-probabilities to return with each generated token, as vLLM's ``logprobs``:
    ``None`` none; ``0`` the sampled token's only; ``k`` also the ``k`` most likely
    tokens' (``BranchDelta.logprobs``). A confidence reward source raises it to the
    ``k`` it needs (``sart.rewards.signals``)."""
