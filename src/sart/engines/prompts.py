"""A prompt's token ids, as the adapters that tokenize (``HFEngine``, ``VLLMEngine``,
``VLLMAsyncEngine``, ``SGLangEngine``) read it.

Token ids are used as they are. Text is tokenized with the tokenizer's
``encode`` (special tokens added, as vLLM and SGLang do for a completion), or,
with ``chat=True``, wrapped as one user message with the chat template and a
generation prompt (what reasoning models expect).

Pure Python: importing it imports neither torch nor vLLM.
"""

from __future__ import annotations

from typing import Any

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


__all__ = ["prompt_ids"]
