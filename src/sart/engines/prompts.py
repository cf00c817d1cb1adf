"""A prompt's token ids, as the adapters that tokenize (``HFEngine``, ``VLLMEngine``,
``VLLMAsyncEngine``, ``SGLangEngine``) read it.

Token ids are used as they are. Text is tokenized with the tokenizer's
``encode`` (special tokens added, as vLLM and SGLang do for a completion), or,
with ``chat=True``, wrapped as one user message with the chat template and a
generation prompt (what reasoning models expect). Token ids outside the
model's vocabulary are refused (``check_vocabulary``), as vLLM's server refuses
them: an embedding lookup would raise on one, and SGLang's scheduler crashes.

Pure Python: importing it imports neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sart.errors import RequestRefused
from sart.types import Prompt


def prompt_ids(tokenizer: Any, prompt: Prompt, chat: bool = False) -> list[int]:
    """``prompt``'s token ids: token ids as they are; text through ``tokenizer``
    (``apply_chat_template`` with ``chat=True``, else ``encode``)."""
    if not isinstance(prompt, str):
        return list(prompt)
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding (a mapping, not a dict); 4.x a list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer.encode(prompt))


def vocabulary_size(tokenizer: Any) -> int | None:
    """The ids a tokenizer knows (its length, which vLLM's server checks prompt ids
    against; transformers' tokenizers have one), ``None`` if it does not say."""
    return len(tokenizer) if hasattr(tokenizer, "__len__") else None


def check_vocabulary(
    request_id: str | None, ids: Sequence[int], size: int | None, what: str
) -> None:
    """Refuse (``RequestRefused``: a server answers 400, as vLLM's) prompt ids outside
    a vocabulary of ``size`` ids (``None``: unknown, only negative ids are refused);
    ``what`` names the vocabulary in the message."""
    bad = [i for i in ids if i < 0 or (size is not None and i >= size)]
    if bad:
        where = "any vocabulary" if size is None else f"{what} of {size} ids"
        raise RequestRefused(
            f"request {request_id!r}: token ids {bad[:5]} lie outside {where}",
            [request_id] if request_id is not None else [],
            field="prompt",
        )


__all__ = ["check_vocabulary", "prompt_ids", "vocabulary_size"]
