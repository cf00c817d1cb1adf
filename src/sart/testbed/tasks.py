"""The testbed task: running sum mod 10, its noisy reasoning traces, and the exact grader.

A question of difficulty ``k`` lists ``k`` digits, each followed by its
position token, ``Q 3 p1 7 p2 5 p3 S``; its gold answer is their sum mod 10. A reasoning trace
adds them one at a time from 0, one step per digit (``p3 5 + 0 = 5``: the
digit at position 3, plus the running value), steps separated by the
word ``"\\n\\n"`` (so ``sart.prm.aggregate.split_steps`` sees the steps)::

    p1 3 + 0 = 3 \\n\\n p2 7 + 3 = 0 \\n\\n wait p2 7 + 3 = 0 \\n\\n p3 5 + 0 = 5 \\n\\n
    answer \\boxed{ 5 }

The long testbed's questions are *cycled* (``Question.rounds``): a few digits
(at most ``MAX_DIGITS``) added over and over, ``rounds`` times, the count of
rounds left (this one included) written at the start of every step::

    Q 3 p1 7 p2 r2 S  ->  r2 p1 3 + 0 = 3 \\n\\n r2 p2 7 + 3 = 0 \\n\\n
    r1 p1 3 + 0 = 3 \\n\\n r1 p2 7 + 3 = 0 \\n\\n answer \\boxed{ 0 }

Every digit a step needs is then also a round earlier in the trace, after the
same position token, and the count is in the step before: a trace of 64 steps
copies by one of a few keys (the long testbed's 4, over up to 16 rounds). With 64
digits in the prompt, a small model copied from the wrong one of neighbouring
positions (64-digit copying stalled at 0.2-0.6 per step, where a trace of 64 steps
needs over 0.99), and with 8 it learned some keys only in questions of some
lengths (see docs/testbed.md).

Training traces are noisy on purpose (``TraceConfig``): a step may write a
wrong result (more often when the addition carries), later steps build on the
wrong value, and ``wait`` steps re-do the previous step (sometimes fixing
it). Each trace draws a re-checking *style*, so lengths vary a lot between
traces of one question while being nearly independent of correctness: the
phenomena SART exploits. The grader is exact: it replays a trace's steps and
compares the boxed answer with the gold one.

Pure Python: importing this module (or ``sart.testbed``) never imports torch.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Collection, Sequence

import attrs

from sart import converters
from sart.answers import extract_answer
from sart.errors import config_check
from sart.prm.aggregate import split_steps

MAX_DIGITS = 8
"""The short testbed's longest question: its vocabulary has position tokens ``p1`` .. ``p8``."""

MAX_POSITIONS = 64
"""The most digits a question's prompt may list."""

MAX_ROUNDS = 16
"""The most rounds of a cycled question (the long testbed's vocabulary has ``r1`` .. ``r16``)."""

QUESTION_END = "S"
"""The last word of a question's prompt: the response starts after it."""

STEP_WORD = "\n\n"
"""The step separator, one word of the vocabulary."""

_STEP = re.compile(r"^(wait )?(?:r(\d+) )?p(\d+) (\d) \+ (\d) = (\d)$")
_ROUND = re.compile(r"^r(\d+)$")


def _rounds_check(_self: object, _attr: attrs.Attribute, value: int | None) -> None:
    config_check(
        value is None or (isinstance(value, int) and 1 <= value <= MAX_ROUNDS),
        "rounds",
        value,
        f"None or 1..{MAX_ROUNDS}",
    )


@attrs.frozen
class Question:
    """``digits`` to add mod 10, ``rounds`` times over if set (a cycled question, as the
    long testbed's); the difficulty is the number of additions."""

    digits: tuple[int, ...] = attrs.field(converter=converters.ints)
    rounds: int | None = attrs.field(default=None, validator=_rounds_check, kw_only=True)

    @digits.validator
    def _check(self, _attr: attrs.Attribute, value: tuple[int, ...]) -> None:
        config_check(
            1 <= len(value) <= MAX_POSITIONS and all(d in range(10) for d in value),
            "digits",
            value,
            f"1 to {MAX_POSITIONS} digits in 0..9",
        )

    @property
    def sequence(self) -> tuple[int, ...]:
        """The digits in the order the steps add them (every round's)."""
        return self.digits * (self.rounds or 1)

    @property
    def difficulty(self) -> int:
        return len(self.sequence)

    @property
    def answer(self) -> str:
        """The gold answer, as ``extract_answer`` returns it from a correct trace."""
        return str(sum(self.sequence) % 10)

    def walk(self) -> list[tuple[str | None, int, int]]:
        """Per addition, in order: the round its step writes (``"r3"``: three rounds to
        go, this one included; ``None`` for a question that is not cycled), its
        position and digit."""
        return [
            (f"r{self.rounds - r}" if self.rounds else None, i, d)
            for r in range(self.rounds or 1)
            for i, d in enumerate(self.digits, start=1)
        ]

    @property
    def prompt(self) -> str:
        # Each digit *before* its position token: a step's "p3" finds the
        # prompt's "p3" by plain token match and reads the digit just before
        # it; with "p3 5" order the model must learn an induction head, which
        # a 4-layer model trained for minutes did not (digits copied from
        # neighbouring positions).
        body = " ".join(f"{d} p{i}" for i, d in enumerate(self.digits, start=1))
        rounds = f" r{self.rounds}" if self.rounds else ""
        return f"Q {body}{rounds} {QUESTION_END}"

    def running(self) -> list[int]:
        """The true running value after each step (step ``i`` adds ``sequence[i - 1]``)."""
        out, value = [], 0
        for d in self.sequence:
            value = (value + d) % 10
            out.append(value)
        return out

    @classmethod
    def from_prompt(cls, prompt: str) -> Question:
        words = prompt.split()
        config_check(
            len(words) >= 4 and words[0] == "Q" and words[-1] == "S", "prompt", prompt, "Q ... S"
        )
        rounds = _ROUND.match(words[-2]) if len(words) >= 5 else None
        body = words[1:-2] if rounds else words[1:-1]
        return cls((int(w) for w in body[::2]), rounds=int(rounds.group(1)) if rounds else None)


def make_question(rng: random.Random, difficulty: int, cycle: int | None = None) -> Question:
    """A uniformly random question of ``difficulty`` additions: as many digits, or with
    ``cycle``, at most ``cycle`` digits over as few rounds as cover ``difficulty``
    (``ceil(difficulty / rounds)`` digits: 40 at cycle 8 is 8 digits, 5 rounds; 30 is
    8 digits, 4 rounds)."""
    if cycle is None:
        return Question(rng.randrange(10) for _ in range(difficulty))
    rounds = -(-difficulty // cycle)
    width = -(-difficulty // rounds)
    return Question((rng.randrange(10) for _ in range(width)), rounds=rounds)


def make_questions(
    seed: int,
    count: int,
    difficulties: Sequence[int] = (3, 4, 5, 6, 7, 8),
    cycle: int | None = None,
    exclude: Collection[str] = (),
) -> list[Question]:
    """``count`` questions cycling through ``difficulties`` (mixed difficulty), seeded.

    A question whose prompt is in ``exclude`` is drawn again at the same difficulty,
    so the first ``k`` questions are still those of ``count=k``.
    """
    rng = random.Random(seed)
    out: list[Question] = []
    while len(out) < count:
        question = make_question(rng, difficulties[len(out) % len(difficulties)], cycle)
        if question.prompt not in exclude:
            out.append(question)
    return out


# --------------------------------------------------------------------------- noisy traces


def _probability(name: str) -> Callable[[object, attrs.Attribute, float], None]:
    def check(_self: object, _attr: attrs.Attribute, value: float) -> None:
        # A float only: the config is written out with the weights, and 0 and 0.0
        # would write two texts for one setting.
        ok = isinstance(value, float) and 0.0 <= value <= 1.0
        config_check(ok, name, value, "a float in [0, 1]")

    return check


@attrs.frozen
class TraceConfig:
    """How the training traces are noisy."""

    error_carry: float = attrs.field(default=0.10, validator=_probability("error_carry"))
    """Chance a step writes a wrong result when its addition carries (sum >= 10)."""
    error_plain: float = attrs.field(default=0.02, validator=_probability("error_plain"))
    """Chance a step writes a wrong result otherwise."""
    styles: tuple[float, ...] = attrs.field(default=(0.05, 0.3, 0.6), converter=converters.floats)
    """Per-trace re-check rates, one drawn uniformly per trace: the length variance."""
    recheck_after_error: float = attrs.field(
        default=0.3, validator=_probability("recheck_after_error")
    )
    """Extra re-check chance right after a wrong step (a model that "feels" unsure)."""
    fix: float = attrs.field(default=0.3, validator=_probability("fix"))
    """Chance a re-check of a wrong step writes the right result."""
    sloppiness: tuple[float, ...] = attrs.field(
        default=(0.25, 1.0, 2.5), converter=converters.floats
    )
    """Per-trace multipliers of the error rates, one drawn uniformly per trace.

    Errors cluster in some traces, as in real reasoning, where a branch that
    slipped early tends to slip again: without this, a perfect judge of the
    first half of a trace reaches an AUROC of only ~0.7 for its final
    correctness (half the errors come later, independently)."""
    max_rechecks: int = attrs.field(default=2)
    """Re-checks of one step at most (each further one has the same chance): bounds length."""
    systematic: float = attrs.field(default=0.0, validator=_probability("systematic"))
    """Chance a wrong result is one more than the right one (else any wrong digit):
    errors that repeat across traces, so a question's wrong answers cluster and a
    majority can be wrong."""
    doubt: float = attrs.field(default=0.0, validator=_probability("doubt"))
    """Re-check rate added to every later step by each error left unfixed: a trace
    that went wrong goes on re-checking (over-thinking), so wrong traces run longer."""
    loop: float = attrs.field(default=0.0, validator=_probability("loop"))
    """Chance that an error left unfixed starts a loop: the step is re-checked over
    and over, with no answer, until the trace is cut ``loop_tokens`` words later."""
    coupled: bool = False
    """Draw a trace's re-check rate and sloppiness together (the i-th of ``styles``
    with the i-th of ``sloppiness``; equal lengths): a trace that hesitates also
    slips, so wrong traces run longer. Unlike ``doubt``, which raises the re-check
    rate after an error the model must find anywhere earlier in its context, this
    over-thinking is learnable from the density of re-checks so far."""
    loop_tokens: int = attrs.field(default=256)
    """How long a training loop runs before it is cut (words; no EOS). Short: a loop
    teaches only that a loop goes on, and one that ran to the generation cap would
    outweigh the rest of its batch in the token-mean loss (2048 words of repeated
    wrong steps against tens of words per short trace)."""

    @styles.validator
    def _check_styles(self, _attr: attrs.Attribute, value: tuple[float, ...]) -> None:
        config_check(
            len(value) >= 1 and all(0.0 <= p < 1.0 for p in value),
            "styles",
            value,
            "one or more rates in [0, 1)",
        )

    @sloppiness.validator
    def _check_sloppiness(self, _attr: attrs.Attribute, value: tuple[float, ...]) -> None:
        config_check(
            len(value) >= 1 and all(m >= 0 for m in value), "sloppiness", value, "multipliers >= 0"
        )

    def __attrs_post_init__(self) -> None:
        if self.coupled:
            config_check(
                len(self.sloppiness) == len(self.styles),
                "sloppiness",
                self.sloppiness,
                f"one multiplier per re-check rate when coupled ({len(self.styles)})",
            )

    @max_rechecks.validator
    def _check_max(self, _attr: attrs.Attribute, value: int) -> None:
        config_check(isinstance(value, int) and value >= 0, "max_rechecks", value, ">= 0")

    @loop_tokens.validator
    def _check_loop_tokens(self, _attr: attrs.Attribute, value: int) -> None:
        config_check(isinstance(value, int) and value >= 1, "loop_tokens", value, ">= 1")


def _step(
    index: int, prev: int, digit: int, result: int, *, wait: bool = False, count: str | None = None
) -> str:
    # The digit right after its position token, as in the prompt: reading it
    # is a plain induction-head copy; the running value comes second. A cycled
    # question's steps carry the rounds left first: the count is then always in
    # the step before, as the running value is (a count written once per round,
    # tens of tokens back, was copied and decremented wrong: docs/testbed.md).
    head = f"{'wait ' if wait else ''}{f'{count} ' if count else ''}"
    return f"{head}p{index} {digit} + {prev} = {result}"


def _wrong(rng: random.Random, right: int) -> int:
    return (right + rng.randrange(1, 10)) % 10


def answer_step(value: int | str) -> str:
    return f"answer \\boxed{{ {value} }}"


def join_steps(steps: Sequence[str]) -> str:
    """The response text of ``steps``: the decoded form (words joined by single spaces)."""
    return f" {STEP_WORD} ".join(steps)


def clean_trace(question: Question) -> str:
    """The error-free trace without re-checks."""
    steps: list[str] = []
    value = 0
    for marker, i, d in question.walk():
        steps.append(_step(i, value, d, (value + d) % 10, count=marker))
        value = (value + d) % 10
    return join_steps([*steps, answer_step(value)])


def noisy_trace(question: Question, rng: random.Random, config: TraceConfig | None = None) -> str:
    """A training trace of ``question``: errors and re-checks drawn from ``config``."""
    return noisy_response(question, rng, config)[0]


def noisy_response(
    question: Question, rng: random.Random, config: TraceConfig | None = None
) -> tuple[str, bool]:
    """A training trace of ``question`` and whether it ends (``False``: a loop, cut
    at ``config.loop_tokens`` words with no answer and no EOS)."""
    config = config or TraceConfig()
    if config.coupled:
        kind = rng.randrange(len(config.styles))
        style, sloppy = config.styles[kind], config.sloppiness[kind]
    else:
        style = rng.choice(config.styles)
        sloppy = rng.choice(config.sloppiness)
    steps: list[str] = []
    value, doubt = 0, 0.0
    for marker, i, d in question.walk():
        right = (value + d) % 10
        p_error = sloppy * (config.error_carry if value + d >= 10 else config.error_plain)
        result = _error(rng, right, config) if rng.random() < p_error else right
        steps.append(_step(i, value, d, result, count=marker))
        for _ in range(config.max_rechecks):
            p_recheck = style + doubt + (config.recheck_after_error if result != right else 0.0)
            if rng.random() >= p_recheck:
                break
            if result != right and rng.random() < config.fix:
                result = right
            steps.append(_step(i, value, d, result, wait=True, count=marker))
        # The draws below happen only where the settings ask for them, so the short
        # testbed's traces (none of these set) are the ones its weights were trained on.
        if result != right and config.doubt:
            doubt += config.doubt
        if result != right and config.loop and rng.random() < config.loop:
            again = _step(i, value, d, result, wait=True, count=marker)
            words = join_steps(steps).split(" ")
            cut = len(words) + config.loop_tokens
            while len(words) < cut:
                words += [STEP_WORD, *again.split(" ")]
            return " ".join(words[:cut]), False
        value = result
    return join_steps([*steps, answer_step(value)]), True


def _error(rng: random.Random, right: int, config: TraceConfig) -> int:
    if config.systematic and rng.random() < config.systematic:
        return (right + 1) % 10
    return _wrong(rng, right)


# --------------------------------------------------------------------------- the grader


def grade(question: Question, text: str) -> bool:
    """Exact grading: the boxed answer (``sart.answers.extract_answer``) is the gold one."""
    return extract_answer(text) == question.answer


def step_values(text: str) -> list[int | None]:
    """The running value a reader holds after each step of ``text``.

    An arithmetic step (or re-check) sets it to the result it writes, right or
    wrong; a step that does not parse (the answer step, an unfinished or
    malformed step) leaves it unchanged. ``None`` before any value is written.
    """
    out: list[int | None] = []
    value: int | None = None
    for step in split_steps(text):
        match = _STEP.match(step.strip())
        if match:
            value = int(match.group(6))
        out.append(value)
    return out


def step_labels(question: Question, text: str) -> list[bool]:
    """Per step: is the trace still on track after it? The PRM's training label.

    True iff the value held after the step equals the true running sum of the
    digits the trace has added so far (the furthest addition it has reached),
    so a wrong step whose error a re-check fixed is "correct again". The
    answer step is labelled by the grader. Steps that use a wrong operand
    (a copy slip), skip a position or miscount a cycled question's rounds left
    are off track; a step that writes no value (cut mid-way, as during
    generation) keeps the label before it.
    """
    truth = question.running()
    width = len(question.digits)

    def rounds_left(addition: int) -> int | None:
        # What a cycled question's step of this addition writes first (None: not cycled).
        return question.rounds - (addition - 1) // width if question.rounds else None

    labels: list[bool] = []
    on_track, done = True, 0  # done: the additions the trace has reached
    for step in split_steps(text):
        stripped = step.strip()
        match = _STEP.match(stripped)
        if match:
            pos, digit, prev, result = (int(match.group(g)) for g in (3, 4, 5, 6))
            valid = 1 <= pos <= width and digit == question.digits[pos - 1]
            written = int(match.group(2)) if match.group(2) else None
            wait = match.group(1) is not None
            # A step must take the next addition (a re-check, the same one), at its
            # position in the round, and start from the true value before it.
            expected = done if wait else done + 1
            at = (expected - 1) % width + 1  # the position the expected addition has
            on_track = (
                valid
                and 1 <= expected <= len(truth)
                and pos == at
                and prev == (truth[expected - 2] if expected >= 2 else 0)
                and result == truth[expected - 1]
                and written == rounds_left(expected)
            )
            if valid:  # the trace is now at the addition of this position nearest to it
                here = expected - at + pos
                near = [k for k in (here - width, here, here + width) if 1 <= k <= len(truth)]
                done = min(near, key=lambda k: (abs(k - expected), -k))
        elif "\\boxed{" in stripped and "}" in stripped:
            on_track = grade(question, stripped)
        # Anything else (a step cut mid-way during generation, a stray word)
        # writes no value: the trace is as on track as before it.
        labels.append(on_track)
    return labels
