"""The testbed task: running sum mod 10, its noisy reasoning traces, and the exact grader.

A question of difficulty ``k`` lists ``k`` digits, each followed by its
position token, ``Q 3 p1 7 p2 5 p3 S``; its gold answer is their sum mod 10. A reasoning trace
adds them one at a time from 0, one step per digit (``p3 5 + 0 = 5``: the
digit at position 3, plus the running value), steps separated by the
word ``"\\n\\n"`` (so ``sart.prm.aggregate.split_steps`` sees the steps)::

    p1 3 + 0 = 3 \\n\\n p2 7 + 3 = 0 \\n\\n wait p2 7 + 3 = 0 \\n\\n p3 5 + 0 = 5 \\n\\n
    answer \\boxed{ 5 }

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
from collections.abc import Sequence

import attrs

from sart.answers import extract_answer
from sart.errors import config_check
from sart.prm.aggregate import split_steps

MAX_DIGITS = 8
"""The short testbed's longest question: its vocabulary has position tokens ``p1`` .. ``p8``."""

MAX_POSITIONS = 64
"""The longest question of any testbed (the long one's vocabulary goes to ``p64``)."""

QUESTION_END = "S"
"""The last word of a question's prompt: the response starts after it."""

STEP_WORD = "\n\n"
"""The step separator, one word of the vocabulary."""

_STEP = re.compile(r"^(wait )?p(\d+) (\d) \+ (\d) = (\d)$")


@attrs.frozen
class Question:
    """``digits`` to add mod 10; the difficulty is their number."""

    digits: tuple[int, ...] = attrs.field(converter=tuple)

    @digits.validator
    def _check(self, _attr: attrs.Attribute, value: tuple[int, ...]) -> None:
        config_check(
            1 <= len(value) <= MAX_POSITIONS and all(d in range(10) for d in value),
            "digits",
            value,
            f"1 to {MAX_POSITIONS} digits in 0..9",
        )

    @property
    def difficulty(self) -> int:
        return len(self.digits)

    @property
    def answer(self) -> str:
        """The gold answer, as ``extract_answer`` returns it from a correct trace."""
        return str(sum(self.digits) % 10)

    @property
    def prompt(self) -> str:
        # Each digit *before* its position token: a step's "p3" finds the
        # prompt's "p3" by plain token match and reads the digit just before
        # it; with "p3 5" order the model must learn an induction head, which
        # a 4-layer model trained for minutes did not (digits copied from
        # neighbouring positions).
        body = " ".join(f"{d} p{i}" for i, d in enumerate(self.digits, start=1))
        return f"Q {body} {QUESTION_END}"

    def running(self) -> list[int]:
        """The true running value after each step (step ``i`` adds digit ``i``)."""
        out, value = [], 0
        for d in self.digits:
            value = (value + d) % 10
            out.append(value)
        return out

    @classmethod
    def from_prompt(cls, prompt: str) -> Question:
        words = prompt.split()
        config_check(
            len(words) >= 4 and words[0] == "Q" and words[-1] == "S", "prompt", prompt, "Q ... S"
        )
        return cls(int(w) for w in words[1:-1:2])


def make_question(rng: random.Random, difficulty: int) -> Question:
    """A uniformly random question with ``difficulty`` digits."""
    return Question(rng.randrange(10) for _ in range(difficulty))


def make_questions(
    seed: int, count: int, difficulties: Sequence[int] = (3, 4, 5, 6, 7, 8)
) -> list[Question]:
    """``count`` questions cycling through ``difficulties`` (mixed difficulty), seeded."""
    rng = random.Random(seed)
    return [make_question(rng, difficulties[i % len(difficulties)]) for i in range(count)]


# --------------------------------------------------------------------------- noisy traces


def _probability(name: str):
    def check(_self: object, _attr: attrs.Attribute, value: float) -> None:
        config_check(isinstance(value, float) and 0.0 <= value <= 1.0, name, value, "in [0, 1]")

    return check


@attrs.frozen
class TraceConfig:
    """How the training traces are noisy."""

    error_carry: float = attrs.field(default=0.10, validator=_probability("error_carry"))
    """Chance a step writes a wrong result when its addition carries (sum >= 10)."""
    error_plain: float = attrs.field(default=0.02, validator=_probability("error_plain"))
    """Chance a step writes a wrong result otherwise."""
    styles: tuple[float, ...] = attrs.field(default=(0.05, 0.3, 0.6), converter=tuple)
    """Per-trace re-check rates, one drawn uniformly per trace: the length variance."""
    recheck_after_error: float = attrs.field(
        default=0.3, validator=_probability("recheck_after_error")
    )
    """Extra re-check chance right after a wrong step (a model that "feels" unsure)."""
    fix: float = attrs.field(default=0.3, validator=_probability("fix"))
    """Chance a re-check of a wrong step writes the right result."""
    sloppiness: tuple[float, ...] = attrs.field(default=(0.25, 1.0, 2.5), converter=tuple)
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

    @max_rechecks.validator
    def _check_max(self, _attr: attrs.Attribute, value: int) -> None:
        config_check(isinstance(value, int) and value >= 0, "max_rechecks", value, ">= 0")

    @loop_tokens.validator
    def _check_loop_tokens(self, _attr: attrs.Attribute, value: int) -> None:
        config_check(isinstance(value, int) and value >= 1, "loop_tokens", value, ">= 1")


def _step(index: int, prev: int, digit: int, result: int, *, wait: bool = False) -> str:
    # The digit right after its position token, as in the prompt: reading it
    # is a plain induction-head copy; the running value comes second.
    return f"{'wait ' if wait else ''}p{index} {digit} + {prev} = {result}"


def _wrong(rng: random.Random, right: int) -> int:
    return (right + rng.randrange(1, 10)) % 10


def answer_step(value: int | str) -> str:
    return f"answer \\boxed{{ {value} }}"


def join_steps(steps: Sequence[str]) -> str:
    """The response text of ``steps``: the decoded form (words joined by single spaces)."""
    return f" {STEP_WORD} ".join(steps)


def clean_trace(question: Question) -> str:
    """The error-free trace without re-checks."""
    steps, value = [], 0
    for i, d in enumerate(question.digits, start=1):
        steps.append(_step(i, value, d, (value + d) % 10))
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
    style = rng.choice(config.styles)
    sloppy = rng.choice(config.sloppiness)
    steps: list[str] = []
    value, doubt = 0, 0.0
    for i, d in enumerate(question.digits, start=1):
        right = (value + d) % 10
        p_error = sloppy * (config.error_carry if value + d >= 10 else config.error_plain)
        result = _error(rng, right, config) if rng.random() < p_error else right
        steps.append(_step(i, value, d, result))
        for _ in range(config.max_rechecks):
            p_recheck = style + doubt + (config.recheck_after_error if result != right else 0.0)
            if rng.random() >= p_recheck:
                break
            if result != right and rng.random() < config.fix:
                result = right
            steps.append(_step(i, value, d, result, wait=True))
        # The draws below happen only where the settings ask for them, so the short
        # testbed's traces (none of these set) are the ones its weights were trained on.
        if result != right and config.doubt:
            doubt += config.doubt
        if result != right and config.loop and rng.random() < config.loop:
            again = _step(i, value, d, result, wait=True)
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
            value = int(match.group(5))
        out.append(value)
    return out


def step_labels(question: Question, text: str) -> list[bool]:
    """Per step: is the trace still on track after it? The PRM's training label.

    True iff the value held after the step equals the true running sum of the
    digits the trace has added so far (the highest position it has reached),
    so a wrong step whose error a re-check fixed is "correct again". The
    answer step is labelled by the grader. Steps that use a wrong operand
    (a copy slip) or skip a position are off track; a step that writes no
    value (cut mid-way, as during generation) keeps the label before it.
    """
    truth = question.running()
    labels: list[bool] = []
    on_track, position = True, 0
    for step in split_steps(text):
        stripped = step.strip()
        match = _STEP.match(stripped)
        if match:
            pos, digit, prev, result = (int(match.group(g)) for g in (2, 3, 4, 5))
            valid = 1 <= pos <= question.difficulty and digit == question.digits[pos - 1]
            wait = match.group(1) is not None
            # A step must take the next position (a re-check, the same one) and
            # start from the true value before it.
            expected_pos = position if wait else position + 1
            on_track = (
                valid
                and pos == expected_pos
                and prev == (truth[pos - 2] if pos >= 2 else 0)
                and result == truth[pos - 1]
            )
            position = pos if valid else position
        elif "\\boxed{" in stripped and "}" in stripped:
            on_track = grade(question, stripped)
        # Anything else (a step cut mid-way during generation, a stray word)
        # writes no value: the trace is as on track as before it.
        labels.append(on_track)
    return labels
