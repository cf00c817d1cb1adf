"""PRM input formats: how a (question, response) pair becomes the token ids a PRM reads.

Needs only a tokenizer object (a transformers fast tokenizer); this module
imports neither torch nor transformers, and both PRM backends
(``sart.prm.hf`` on transformers, ``sart.prm.vllm`` on vLLM) use it as is.

The response is split into steps on ``"\\n\\n"`` (``sart.prm.aggregate``),
each step is encoded with the token that rates it, and the input is cut to
the PRM's context (``sart.prm.window``). The formats:

- ``QwenFormat``, Qwen/Qwen2.5-Math-PRM-7B's: the chat template with the
  system prompt, the question as the user turn, and as the assistant turn
  the steps each followed by ``<extra_0>``; a step's reward is the softmax
  of the two logits at its ``<extra_0>``, column 1.
- ``StepTagFormat``, Math-Shepherd's (peiyi9979/math-shepherd-mistral-7b-prm):
  ``"{question} {step1} ки\\n{step2} ки"``; a step's reward is the softmax
  over the "+" and "-" logits at its tag, the "+" part.

Both read rewards the same way from the (bad, good) logits at the rating
tokens: ``good_probability``. ``encode_item`` turns a ``ScoreItem`` into an
input, its failures into ``PRMError`` naming the request.
"""

from __future__ import annotations

import bisect
import itertools
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from sart.errors import ConfigError, PRMError, config_check
from sart.prm.aggregate import split_steps
from sart.prm.base import ScoreItem
from sart.prm.last_step import two_way_reward
from sart.prm.window import ContextLimit, ContextOverflow, Encoded, fit_context

QWEN_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
"""The system prompt of Qwen2.5-Math-PRM's documented usage."""

__all__ = [
    "QWEN_SYSTEM_PROMPT",
    "InputFormat",
    "QwenFormat",
    "QwenFormatOptions",
    "StepTagFormat",
    "StepTagFormatOptions",
    "TagNotFound",
    "encode_item",
    "good_probability",
    "single_token",
]


# --------------------------------------------------------------------------- options


def _check_token(_self: Any, attr: attrs.Attribute, value: object) -> None:
    """A token option: a string that must encode to one token, or a token id."""
    config_check(
        isinstance(value, str | int) and not isinstance(value, bool),
        attr.name,
        value,
        "a token (str) or a token id (int)",
    )


@attrs.frozen(kw_only=True, slots=False)
class QwenFormatOptions:
    """The options of the Qwen2.5-Math-PRM format."""

    system_prompt: str | None = attrs.field(default=QWEN_SYSTEM_PROMPT)
    """The chat's system turn (``None``: no system turn)."""
    step_separator: str = attrs.field(default="<extra_0>")
    """The token after each step, whose logits rate it; must be one token."""

    @system_prompt.validator
    def _check_system_prompt(self, _attr: attrs.Attribute, value: object) -> None:
        config_check(
            value is None or isinstance(value, str), "system_prompt", value, "None or a str"
        )

    @step_separator.validator
    def _check_separator(self, _attr: attrs.Attribute, value: object) -> None:
        config_check(
            isinstance(value, str) and value != "", "step_separator", value, "a non-empty str"
        )


@attrs.frozen(kw_only=True, slots=False)
class StepTagFormatOptions:
    """The options of the Math-Shepherd (step tag) format."""

    step_tag: str | int = attrs.field(default="ки", validator=_check_token)
    """The tag after each step, whose logits rate it; one token."""
    good_token: str | int = attrs.field(default=" +", validator=_check_token)
    """The token whose probability (against ``bad_token``) is the reward."""
    bad_token: str | int = attrs.field(default=" -", validator=_check_token)


# --------------------------------------------------------------------------- shared


class TagNotFound(Exception):
    """A step's rating token is not where the format puts it (the tokenizer merged it)."""


def encode_item(prm: Any, item: ScoreItem, owner: str | None = None) -> Encoded:
    """``prm.encode(question, text)`` for one item, failures as ``PRMError`` naming its
    request. ``owner`` names the PRM in the message (default: ``prm``'s class)."""
    request = item.branch.request_id
    if not isinstance(item.prompt, str):
        raise PRMError(
            f"{owner or type(prm).__name__} needs the question as text, but request "
            f"{request!r} has a token-id prompt (branch {item.branch}); give the request "
            "a str prompt",
            [request],
        )
    try:
        return prm.encode(item.prompt, item.text)
    except ContextOverflow as exc:
        raise PRMError(
            f"PRM input for branch {item.branch} is {exc} (overflow='error')", [request]
        ) from None
    except TagNotFound as exc:
        raise PRMError(f"branch {item.branch}: {exc}", [request]) from None


def good_probability(two_way: Any) -> list[float]:
    """The reward of each row of ``[n, 2]`` (bad, good) logits: the softmax's good
    column (``sart.prm.last_step.two_way_reward``, the one formula every PRM uses).
    ``two_way`` is a torch tensor (only its methods are used: this module imports no
    torch); it is read back once."""
    return [two_way_reward(pair) for pair in two_way.double().tolist()]


def single_token(tokenizer: Any, token: str | int, field: str) -> int:
    """The id of ``token``: an id as is (checked), a string if it encodes to one id."""
    if isinstance(token, int):
        config_check(0 <= token < len(tokenizer), field, token, f"a token id < {len(tokenizer)}")
        return token
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ConfigError(
            f"{field}={token!r} must be a single token of this tokenizer, but it encodes to "
            f"{len(ids)} tokens {pieces} (ids {ids}); give another spelling (with or without "
            "a leading space) or the token id itself"
        )
    return ids[0]


class InputFormat:
    """A format: ``encode_steps`` (subclasses) tokenises a question and its steps;
    ``encode`` splits a response into steps and fits the result to ``limit``.

    ``options`` are the format's own (an instance of its ``Options``, default
    ones if ``None``; a PRM's options object, which holds them, does too);
    ``limit`` defaults to ``ContextLimit()``; ``owner`` names the PRM using the
    format in error messages (default: the format's class). Subclasses check
    the tokenizer and set themselves up in ``_prepare``.
    """

    Options: ClassVar[type] = object

    def __init__(
        self,
        tokenizer: Any,
        options: Any = None,
        limit: ContextLimit | None = None,
        *,
        owner: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limit = ContextLimit() if limit is None else limit
        self.owner = owner or type(self).__name__
        self._prepare(self.Options() if options is None else options)

    def _prepare(self, options: Any) -> None:
        """Check the tokenizer against ``options`` and keep what encoding needs."""

    def encode_steps(self, question: str, steps: list[str]) -> Encoded:
        """The whole input for ``steps`` (not windowed)."""
        raise NotImplementedError

    def encode(self, prompt: str, text: str) -> Encoded:
        """The input the model sees for ``text`` answering ``prompt`` (windowed)."""
        steps = split_steps(text)
        if not steps:
            return Encoded((), (), ())
        return fit_context(self.encode_steps(prompt, steps), self.limit)

    def encode_item(self, item: ScoreItem) -> Encoded:
        """``encode`` of one item; its failures are ``PRMError`` naming its request."""
        return encode_item(self, item, self.owner)


# --------------------------------------------------------------------------- Qwen2.5-Math-PRM


_STEP_MEMO = 1 << 14
"""Tokenised steps ``QwenFormat`` remembers (least recently used out first)."""

_PREFIX_MEMO = 1024
"""Tokenised chat prefixes (one per question) ``QwenFormat`` remembers."""


class QwenFormat(InputFormat):
    """Qwen2.5-Math-PRM's input, built from token ids rather than text.

    The chat template rendered with a placeholder as the assistant turn is
    split around it into a prefix (tokenised once per question), each step is
    tokenised on its own and followed by the separator id, and the template's
    suffix is left out (the model is causal: the logits at the separators do
    not depend on it). The separator is a special token, so no BPE merge
    crosses it and these ids are those of the documented full-text encoding
    with byte-level tokenizers such as Qwen's (a step starting with whitespace
    may tokenise differently after the template's ``"\\n"``);
    ``reference_ids`` is that encoding, and the constructor warns if the two
    disagree on a sample.
    """

    Options = QwenFormatOptions
    _PLACEHOLDER = "SARTSTEPSPLACEHOLDER"

    def _prepare(self, options: QwenFormatOptions) -> None:
        tokenizer = self.tokenizer
        self.system_prompt = options.system_prompt
        self.step_separator = options.step_separator
        self.separator_id = single_token(tokenizer, options.step_separator, "step_separator")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{self.owner} needs a tokenizer with a chat template")
        self._prefixes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._steps: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._check_encoding()

    def messages(self, question: str, response: str) -> list[dict[str, str]]:
        """The chat of the documented usage, with ``response`` as the assistant turn."""
        system = (
            []
            if self.system_prompt is None
            else [{"role": "system", "content": self.system_prompt}]
        )
        return [
            *system,
            {"role": "user", "content": question},
            {"role": "assistant", "content": response},
        ]

    def reference_ids(self, question: str, steps: Sequence[str]) -> list[int]:
        """The documented full-text encoding: steps joined by the separator, with
        a trailing one, as the assistant turn of the rendered chat."""
        sep = self.step_separator
        text = self.tokenizer.apply_chat_template(
            self.messages(question, sep.join(steps) + sep), tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_steps(self, question: str, steps: list[str]) -> Encoded:
        segments = tuple((*ids, self.separator_id) for ids in self._step_ids(steps))
        return Encoded(self._prefix_ids(question), segments, tuple(len(s) - 1 for s in segments))

    def _prefix_ids(self, question: str) -> tuple[int, ...]:
        ids = self._prefixes.get(question)
        if ids is None:
            text = self.tokenizer.apply_chat_template(
                self.messages(question, self._PLACEHOLDER), tokenize=False
            )
            # The assistant turn comes last: its placeholder is the last occurrence.
            where = text.rfind(self._PLACEHOLDER)
            if where < 0:
                raise ConfigError("the chat template drops the assistant turn's content")
            ids = tuple(self.tokenizer(text[:where], add_special_tokens=False)["input_ids"])
            self._prefixes[question] = ids
            if len(self._prefixes) > _PREFIX_MEMO:
                self._prefixes.popitem(last=False)
        return ids

    def _step_ids(self, steps: list[str]) -> list[tuple[int, ...]]:
        """Each step tokenised on its own, memoised: from one check of a branch to
        the next only its last step changes, and tokenising all of them again
        cost a fifth of a batched check of the testbed PRM
        (``benchmarks/prm_batching.py``)."""
        memo = self._steps
        missing = list(dict.fromkeys(step for step in steps if step not in memo))
        if missing:
            encoded = self.tokenizer(missing, add_special_tokens=False)["input_ids"]
            memo.update(zip(missing, map(tuple, encoded)))
        out = []
        for step in steps:
            out.append(memo[step])
            memo.move_to_end(step)
        while len(memo) > _STEP_MEMO:
            memo.popitem(last=False)
        return out

    def _check_encoding(self) -> None:
        question, steps = "What is 12 + 30?", ["Step 1: 12 + 30 = 42.", "So the answer is 42."]
        ours = self.encode_steps(question, steps).ids()
        if self.reference_ids(question, steps)[: len(ours)] != ours:
            warnings.warn(
                f"{self.owner}: this tokenizer encodes steps differently on their own than in "
                "the full chat text; rewards may differ slightly from the documented usage",
                stacklevel=4,
            )


# --------------------------------------------------------------------------- Math-Shepherd


class StepTagFormat(InputFormat):
    """Math-Shepherd's input: ``"{question} {step1} {tag}\\n{step2} {tag}"``.

    Tokenised as one text (as in the model card; special tokens such as BOS
    added). The reward of a step is read at its tag from the ``good_token``
    and ``bad_token`` logits (``good_id``, ``bad_id``). Tokens may be given as
    strings, which must encode (``tokenizer.encode(s, add_special_tokens=False)``)
    to exactly one id, or as ids. Defaults fit byte-level tokenizers (the demo
    model: ``"Ġ+"``, ``"Ġ-"``); for peiyi9979/math-shepherd-mistral-7b-prm,
    whose model card reads the ids from ``tokenizer.encode("+ -")[1:]``, pass
    those ids (648 and 387 there). Tags are located with the tokenizer's
    offsets, so a ``"ки"`` inside a step's own text is not mistaken for one; a
    tokenizer that merges the tag with its neighbours is refused at
    construction.
    """

    Options = StepTagFormatOptions

    def _prepare(self, options: StepTagFormatOptions) -> None:
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{self.owner} needs a fast tokenizer (it locates tags by offsets)")
        step_tag, good, bad = options.step_tag, options.good_token, options.bad_token
        self.tag_id = single_token(tokenizer, step_tag, "step_tag")
        self.step_tag = (
            step_tag if isinstance(step_tag, str) else tokenizer.decode([step_tag]).strip()
        )
        self.good_id = single_token(tokenizer, good, "good_token")
        self.bad_id = single_token(tokenizer, bad, "bad_token")
        if self.good_id == self.bad_id:
            raise ConfigError(f"good_token={good!r} and bad_token={bad!r} are the same token")
        try:
            self.encode_steps("What is 1 + 1?", ["1 + 1 = 2.", "The answer is 2."])
        except TagNotFound as exc:
            raise ConfigError(f"step_tag={step_tag!r}: {exc}") from None

    def render(self, question: str, steps: Sequence[str]) -> tuple[str, list[int], list[int]]:
        """The input text, where each step's segment starts, and where each tag is (in chars)."""
        text, starts, tags = question, [], []
        for i, step in enumerate(steps):
            starts.append(len(text))
            text += f"{'' if i else ' '}{step} "
            tags.append(len(text))
            text += self.step_tag + ("\n" if i < len(steps) - 1 else "")
        return text, starts, tags

    def encode_steps(self, question: str, steps: list[str]) -> Encoded:
        text, starts, tags = self.render(question, steps)
        enc = self.tokenizer(text, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        # A segment starts at the first token that starts at or after its first
        # character. Special tokens (empty spans) are skipped in the search.
        spans = [(s, e, k) for k, (s, e) in enumerate(offsets) if e > s]
        span_starts = [s for s, _, _ in spans]
        bounds = [_first_at_or_after(spans, span_starts, c, len(ids)) for c in starts]
        bounds.append(len(ids))
        tag_tokens: list[int] = []
        for i, c in enumerate(tags):
            k = _token_at(spans, span_starts, c)
            if k is None or ids[k] != self.tag_id or not bounds[i] <= k < bounds[i + 1]:
                raise TagNotFound(
                    f"the tag after step {i} is not tokenised as the single token "
                    f"{self.tag_id} (it merges with the text around it)"
                )
            tag_tokens.append(k)
        segments = tuple(tuple(ids[a:b]) for a, b in itertools.pairwise(bounds))
        rating = tuple(k - a for k, a in zip(tag_tokens, bounds))
        return Encoded(tuple(ids[: bounds[0]]), segments, rating)


Span = tuple[int, int, int]  # (first char, end char, token index), by first char


def _first_at_or_after(spans: Sequence[Span], starts: Sequence[int], char: int, end: int) -> int:
    """Index of the first token starting at or after ``char`` (``end`` if none)."""
    i = bisect.bisect_left(starts, char)
    return spans[i][2] if i < len(spans) else end


def _token_at(spans: Sequence[Span], starts: Sequence[int], char: int) -> int | None:
    """Index of the token covering ``char``, if one does."""
    i = bisect.bisect_right(starts, char) - 1
    return spans[i][2] if i >= 0 and char < spans[i][1] else None
