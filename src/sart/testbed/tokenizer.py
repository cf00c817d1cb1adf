"""The testbed's word-level tokenizer: one token per space-separated word.

``"\\n\\n"`` is a word of its own, so a decoded response (words joined by
single spaces) splits into steps with ``sart.prm.aggregate.split_steps``, and
``\\boxed{`` ``d`` ``}`` decode to ``\\boxed{ d }``, which
``sart.answers.extract_answer`` reads as ``d``. ``<step>`` is the PRM's step
separator (a special token, as ``<extra_0>`` is for Qwen2.5-Math-PRM), and
the chat template (the messages' contents joined by spaces, no system prompt)
is what ``sart.prm.hf.QwenMathPRM`` needs to build its prefix.

No special tokens are added on encoding: ``tokenizer(prompt)`` gives the
prompt's words, at training as at inference in sart's engines.

Needs the ``[hf]`` extra (tokenizers, transformers).
"""

from __future__ import annotations

from typing import Any

from sart.testbed.tasks import MAX_DIGITS, MAX_POSITIONS, MAX_ROUNDS, STEP_WORD

EOS = "</s>"
UNK = "[UNK]"
PRM_SEPARATOR = "<step>"
SPECIAL_TOKENS = (UNK, EOS, PRM_SEPARATOR)


def words(max_digits: int = MAX_DIGITS, max_rounds: int = 0) -> tuple[str, ...]:
    """The vocabulary's words for questions of up to ``max_digits`` digits and
    ``max_rounds`` rounds (0: questions that are not cycled)."""
    return (
        "Q",
        "S",
        *(f"p{i}" for i in range(1, max_digits + 1)),
        *(f"r{i}" for i in range(1, max_rounds + 1)),
        *(str(d) for d in range(10)),
        "+",
        "=",
        STEP_WORD,
        "wait",
        "answer",
        "\\boxed{",
        "}",
    )


WORDS = words()
"""The short testbed's words."""
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %} {% endif %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)
"""The contents joined by single spaces: the PRM sees ``question response``."""


def build_tokenizer(max_digits: int = MAX_DIGITS, max_rounds: int = 0) -> Any:
    """The ``PreTrainedTokenizerFast`` of a testbed whose questions have up to
    ``max_digits`` digits and ``max_rounds`` rounds (deterministic: a fixed
    vocabulary; the defaults are the short testbed's)."""
    from sart.errors import config_check

    config_check(1 <= max_digits <= MAX_POSITIONS, "max_digits", max_digits, f"1..{MAX_POSITIONS}")
    config_check(0 <= max_rounds <= MAX_ROUNDS, "max_rounds", max_rounds, f"0..{MAX_ROUNDS}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate((*SPECIAL_TOKENS, *words(max_digits, max_rounds)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split on single spaces only (not on all whitespace): "\n\n" stays a word.
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    # Decoding joins the words with single spaces (WordPiece's decoder without
    # its "##" prefix handling, and without cleanup that would eat spaces).
    tok.decoder = decoders.WordPiece(prefix="\x00", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[PRM_SEPARATOR],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
