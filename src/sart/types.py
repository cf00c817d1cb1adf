"""Small value types shared by every layer: ids, status enums, sampling settings."""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable
from typing import NamedTuple

import attrs

from sart.errors import config_check, finite_number, int_at_least

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


def check_temperature(_inst: object, _attr: attrs.Attribute, value: float) -> None:
    """attrs validator of a sampling temperature (a request's, a server's default)."""
    config_check(finite_number(value) and value >= 0.0, "temperature", value, "a number >= 0")


def _in_range(
    low: float, high: float, *, open_low: bool = False
) -> Callable[[object, attrs.Attribute, object], None]:
    """An attrs validator: a finite number in [low, high] ((low, high] if ``open_low``)."""
    rule = f"a number in {'(' if open_low else '['}{low:g}, {high:g}]"

    def check(_inst: object, attr: attrs.Attribute, value: object) -> None:
        ok = finite_number(value)
        if ok:
            number = float(value)  # type: ignore[arg-type]
            ok = (low < number if open_low else low <= number) and number <= high
        config_check(ok, attr.name, value, rule)

    return check


check_top_p = _in_range(0.0, 1.0, open_low=True)
"""attrs validator of a nucleus mass ``top_p`` (a request's, a server's default)."""


def _check_bool(_inst: object, attr: attrs.Attribute, value: object) -> None:
    config_check(isinstance(value, bool), attr.name, value, "true or false")


def _to_top_k(value: object) -> object:
    # vLLM and SGLang both read 0 and -1 as "every token".
    return None if value in (0, -1) and not isinstance(value, bool) else value


def _token_ids(value: object) -> tuple[int, ...]:
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    )
    config_check(ok, "stop_token_ids", value, "a list of token ids (ints >= 0)")
    return tuple(value)  # type: ignore[arg-type]


def _stop_strings(value: object) -> tuple[str, ...]:
    """vLLM's ``stop``: one string, or a list of them (a string is not taken as the
    list of its characters)."""
    if isinstance(value, str):
        return (value,)
    ok = isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value)
    config_check(ok, "stop", value, "a string or a list of strings")
    return tuple(value)  # type: ignore[arg-type]


@attrs.frozen
class SamplingSettings:
    """How each branch samples. Branch ``j`` of a request uses seed ``seed + j``."""

    temperature: float = attrs.field(default=0.6, validator=check_temperature)
    """Sampling temperature; 0.6 is DeepSeek-R1's recommendation for reasoning."""
    top_p: float = attrs.field(default=0.95, validator=check_top_p)
    """Nucleus sampling mass."""
    max_tokens: int = attrs.field(default=16384, validator=int_at_least(1))
    """Cap on generated tokens per branch; reaching it ends the branch as ``TRUNCATED``."""
    seed: int | None = attrs.field(default=None, validator=int_at_least(0, optional=True))
    """Base seed; ``None`` derives a stable one from the request id."""
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    """Stop strings (one string, or a list); generating one ends the branch as
    ``FINISHED``."""
    logprobs: int | None = attrs.field(default=None, validator=int_at_least(0, optional=True))
    """Log-probabilities to return with each generated token, as vLLM's ``logprobs``:
    ``None`` none; ``0`` the sampled token's only; ``k`` also the ``k`` most likely
    tokens' (``BranchDelta.logprobs``). A confidence reward source raises it to the
    ``k`` it needs (``sart.confidence.signals``)."""
    # vLLM's sampling fields beyond those above (``EXTRA_SAMPLING``): the same names,
    # meanings and ranges as vLLM's ``SamplingParams``; an engine honours those it
    # lists in its ``sampling_fields``, and refuses a request that sets another.
    top_k: int | None = attrs.field(
        default=None,
        converter=_to_top_k,
        validator=int_at_least(1, optional=True, rule="0 or -1 (every token), or an int >= 1"),
    )
    """Sample among the ``k`` most likely tokens; ``None`` (or 0, -1): all of them."""
    min_p: float = attrs.field(default=0.0, validator=_in_range(0.0, 1.0))
    """Drop tokens whose probability is below ``min_p`` times the most likely one's."""
    repetition_penalty: float = attrs.field(
        default=1.0, validator=_in_range(0.0, 2.0, open_low=True)
    )
    """Divide the positive logits (multiply the negative ones) of tokens already in the
    prompt or the output by this; 1: no penalty."""
    presence_penalty: float = attrs.field(default=0.0, validator=_in_range(-2.0, 2.0))
    """Subtract this from the logit of every token already in the output."""
    frequency_penalty: float = attrs.field(default=0.0, validator=_in_range(-2.0, 2.0))
    """Subtract this times its count in the output from every token's logit."""
    min_tokens: int = attrs.field(default=0, validator=int_at_least(0))
    """Tokens generated before EOS or a stop token may end a branch."""
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    """Token ids that end a branch as ``FINISHED``, as EOS does (kept in the output)."""
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)
    """Go on past EOS (only ``max_tokens``, stop strings and ``stop_token_ids`` end it)."""
    skip_special_tokens: bool = attrs.field(default=True, validator=_check_bool)
    """Leave special tokens out of the text."""
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_check_bool)
    """Keep the stop string that ended a branch at the end of its text."""

    def __attrs_post_init__(self) -> None:
        config_check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"<= max_tokens ({self.max_tokens})",
        )

    def extra_fields(self, max_tokens: int | None = None) -> dict[str, object]:
        """The ``EXTRA_SAMPLING`` fields set away from their defaults, by vLLM's name,
        as JSON takes them (``stop_token_ids`` a list); ``max_tokens``: the tokens a
        fork or a resume has left to go, which ``min_tokens`` is kept within."""
        out: dict[str, object] = {}
        for name, default in EXTRA_SAMPLING.items():
            value = getattr(self, name)
            if value != default:
                out[name] = list(value) if isinstance(value, tuple) else value
        if "min_tokens" in out and max_tokens is not None:
            out["min_tokens"] = min(self.min_tokens, max_tokens)
        return out


#: vLLM's sampling fields beyond temperature, top_p, max_tokens, seed, stop and
#: logprobs, with the values that leave sampling as it is: an engine that does not
#: list a field in its ``sampling_fields`` takes a request only at this value.
EXTRA_SAMPLING: dict[str, object] = {
    "top_k": None,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "stop_token_ids": (),
    "ignore_eos": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
}
