"""Branch scripts: what a fake branch generates and what a scripted PRM says about it.

One ``BranchScript`` per branch describes both sides, so the same script can
drive ``FakeEngine`` (length, text, log-probabilities) and ``ScriptedPRM``
(rewards). The fields match the trace format of ``sart bench`` (length,
answer, rewards, final_reward, logprobs, confidences, logprob_every).

Scripted log-probabilities. When a request asks for them
(``SamplingSettings.logprobs``), ``FakeEngine`` reports for every token the
script's ``logprobs`` and ``confidences``: piecewise constant over segments of
``logprob_every`` tokens (value ``j`` applies to tokens ``j*every ..
(j+1)*every - 1``, the last one repeats to the branch's end), so a 16k-token
branch costs a few hundred numbers, not 16k. A token's confidence ``C`` is
DeepConf's: minus the mean of the top-``k`` logprobs, higher is more confident.
Without a script value the sampled token's logprob is 0.0 and its confidence
0.0. The ``k`` top values reported are ``k`` copies of ``-C``: their negative
mean is the scripted confidence (up to rounding), but they are not a real
distribution (their probabilities may sum past 1, and the sampled token's
logprob need not be among them).
"""

from __future__ import annotations

import functools
import math
import random
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

import attrs

from sart import converters
from sart.errors import config_check, int_at_least
from sart.messages import TokenLogprobs
from sart.types import BranchId

#: Default reward when a script has none: 0.5 is not below the paper's alpha,
#: so unscripted branches are never pruned in phase 1.
NEUTRAL_REWARD = 0.5
#: Tokens per segment of scripted log-probabilities when a script does not say.
DEFAULT_LOGPROB_EVERY = 16


def _check_rewards(_inst: object, _attr: attrs.Attribute, value: tuple[float, ...]) -> None:
    for r in value:
        # NaN is allowed on purpose: tests script it to check NaN handling.
        config_check(math.isnan(r) or 0.0 <= r <= 1.0, "rewards", value, "in [0, 1] (or NaN)")


def _number_checker(
    field: str, ok: Callable[[float], bool], rule: str
) -> Callable[[object, attrs.Attribute, object], None]:
    """An attrs validator: a tuple of finite numbers that pass ``ok``, else
    ``ConfigError`` naming the field, the entry and its value."""

    def check(_inst: object, _attr: attrs.Attribute, value: object) -> None:
        config_check(isinstance(value, tuple), field, value, "a sequence of numbers")
        for i, x in enumerate(cast(tuple[object, ...], value)):  # a tuple: checked above
            ok_x = isinstance(x, float) and math.isfinite(x) and ok(x)
            config_check(ok_x, f"{field}[{i}]", x, rule)

    return check


def _floats(value: object) -> object:
    """A sequence of numbers as a tuple of floats; anything else (a number too large
    for a float included) is left for the validator to refuse."""
    try:
        items = tuple(cast(Iterable[object], value))  # not iterable: TypeError
    except TypeError:
        return value
    return tuple(_float(x) for x in items)


def _float(x: object) -> object:
    if isinstance(x, int) and not isinstance(x, bool):
        try:
            return float(x)
        except OverflowError:
            return x
    return x


@attrs.frozen
class BranchScript:
    """One scripted branch."""

    length: int = attrs.field(default=16, validator=int_at_least(1))
    """Tokens until EOS. Beyond ``max_tokens`` the branch is truncated instead."""
    answer: str = "42"
    """The answer the default text ends with (as ``\\boxed{answer}``)."""
    text: str | None = None
    """Full response text, split evenly over ``length`` tokens; default: ``filler``
    repeated, then ``\\boxed{answer}`` as the last token."""
    rewards: tuple[float, ...] = attrs.field(
        default=(), converter=converters.floats, validator=_check_rewards
    )
    """PRM reward after ``(j+1) * every`` tokens, for ``j = 0, 1, ...`` (the last repeats)."""
    final_reward: float | None = None
    """PRM reward once completed; default: the last of ``rewards``, else 0.5."""
    filler: str = "step "
    """Text of each token before the last when ``text`` is None (simulated
    workloads use ``""`` so that long branches cost no memory)."""
    logprobs: tuple[float, ...] = attrs.field(
        default=(),
        converter=_floats,
        validator=_number_checker("logprobs", lambda x: x <= 0.0, "a finite number <= 0"),
    )
    """The sampled token's logprob over segment ``j`` of ``logprob_every`` tokens
    (the last repeats; finite, <= 0); default 0.0. See the module docstring."""
    confidences: tuple[float, ...] = attrs.field(
        default=(),
        converter=_floats,
        validator=_number_checker("confidences", lambda x: x >= 0.0, "a finite number >= 0"),
    )
    """Token confidence ``C`` (minus the mean of the top-``k`` logprobs) over segment
    ``j`` (the last repeats; finite, >= 0); default 0.0."""
    logprob_every: int = attrs.field(default=DEFAULT_LOGPROB_EVERY, validator=int_at_least(1))
    """Tokens per segment of ``logprobs`` and ``confidences``."""

    def text_span(self, start: int, end: int) -> str:
        """Text of tokens ``start .. end-1`` (0-based), computed without
        materialising the tokens, so a 30k-token branch costs nothing."""
        end = min(end, self.length)
        if start >= end:
            return ""
        if self.text is not None:
            size = len(self.text)
            return self.text[start * size // self.length : end * size // self.length]
        fill = self.filler * (min(end, self.length - 1) - start) if self.filler else ""
        return fill + f"\\boxed{{{self.answer}}}" if end == self.length else fill

    def tokens(self) -> list[str]:
        """The ``length`` token texts, in order (materialised: for tests and small scripts)."""
        return [self.text_span(i, i + 1) for i in range(self.length)]

    def logprob_at(self, position: int) -> float:
        """The scripted logprob of the sampled token at ``position`` (0-based)."""
        return _segment(self.logprobs, position // self.logprob_every, 0.0)

    def confidence_at(self, position: int) -> float:
        """The scripted confidence of the token at ``position`` (0-based)."""
        return _segment(self.confidences, position // self.logprob_every, 0.0)

    def logprobs_span(self, start: int, end: int, k: int) -> tuple[TokenLogprobs, ...]:
        """One ``TokenLogprobs`` per token ``start .. end-1`` (0-based), with ``k`` top
        values (see the module docstring). Built per segment: a segment's tokens share
        one ``TokenLogprobs``, and past the last scripted values one fill covers the rest."""
        every = self.logprob_every
        last = max(len(self.logprobs), len(self.confidences)) - 1  # constant from here on
        out: list[TokenLogprobs] = []
        pos = start
        while pos < end:
            j = pos // every
            stop = end if j >= last else min(end, (j + 1) * every)
            confidence = _segment(self.confidences, j, 0.0)
            item = TokenLogprobs(_segment(self.logprobs, j, 0.0), (0.0 - confidence,) * k)
            out += [item] * (stop - pos)
            pos = stop
        return tuple(out)

    def reward_at(self, num_tokens: int, every: int, final: bool) -> float:
        """The scripted reward after ``num_tokens`` tokens (``final``: once completed)."""
        if final and self.final_reward is not None:
            return self.final_reward
        if not self.rewards:
            return NEUTRAL_REWARD
        if final:
            return self.rewards[-1]
        j = max(0, math.ceil(num_tokens / every) - 1)
        return self.rewards[min(j, len(self.rewards) - 1)]


def _segment(values: tuple[float, ...], j: int, default: float) -> float:
    """Segment ``j``'s value: the last one past the end, ``default`` if there is none."""
    if not values:
        return default
    return values[j] if j < len(values) else values[-1]


#: A script gives each branch its behaviour.
Script = Callable[[BranchId], BranchScript]
ScriptLike = Script | Mapping[str, Sequence[BranchScript]] | None


class ScriptTable:
    """A ``{request_id: [script per branch index]}`` table as a script; missing
    entries use ``default``.

    Forks (``FakeEngine`` calls ``fork``) are recorded: the child continues with
    its parent's script. Give the *same* table to the engine and to
    ``ScriptedPRM`` when a policy forks (Rebase), so that the PRM sees the
    children the engine made.
    """

    def __init__(
        self, table: Mapping[str, Sequence[BranchScript]], default: BranchScript | None = None
    ) -> None:
        self._table = {rid: tuple(branches) for rid, branches in table.items()}
        self._default = default if default is not None else BranchScript()
        self._forks: dict[BranchId, BranchScript] = {}

    def __call__(self, branch: BranchId) -> BranchScript:
        forked = self._forks.get(branch)
        if forked is not None:
            return forked
        branches = self._table.get(branch.request_id, ())
        return branches[branch.index] if branch.index < len(branches) else self._default

    def fork(self, child: BranchId, parent: BranchId, position: int) -> BranchScript:
        script = self._forks[child] = self(parent)
        return script


def as_script(script: ScriptLike, default: BranchScript | None = None) -> Script:
    """Accept a callable (a ``ScriptTable``, a trace's script...), or a
    ``{request_id: [script per branch index]}`` mapping (made a ``ScriptTable``
    with ``default`` for missing entries), or ``None`` (``random_scripts(0)``)."""
    if script is None:
        return random_scripts(seed=0)
    if callable(script):
        return script
    return ScriptTable(script, default)


def random_scripts(
    seed: int = 0,
    *,
    median_length: int = 64,
    sigma: float = 0.8,
    answers: Sequence[str] = ("42", "41", "43"),
    p_correct: float = 0.6,
    every: int = 16,
) -> Script:
    """Seeded pseudo-random scripts, stable per branch id: lognormal lengths (a
    heavy tail, as reasoning lengths have), answers[0] with probability
    ``p_correct`` else another answer, and reward trajectories that are higher,
    on average, for branches with the first answer."""

    # Cached: the engine and the PRM both look a branch up, the PRM at every check.
    @functools.lru_cache(maxsize=1 << 16)
    def make(branch: BranchId) -> BranchScript:
        rng = random.Random(zlib.crc32(f"{seed}/{branch.request_id}/{branch.index}".encode()))
        length = max(1, round(median_length * math.exp(rng.gauss(0.0, sigma))))
        correct = rng.random() < p_correct
        answer = answers[0] if correct or len(answers) == 1 else rng.choice(answers[1:])
        base = 0.7 if correct else 0.35
        rewards = tuple(
            min(1.0, max(0.0, base + rng.gauss(0.0, 0.15)))
            for _ in range(max(1, math.ceil(length / every)))
        )
        return BranchScript(length=length, answer=answer, rewards=rewards)

    return make
