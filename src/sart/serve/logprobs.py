"""A response's ``logprobs``: the chosen branch's tokens, named by the policy's tokenizer.

A request that asks for ``logprobs`` (chat: ``logprobs: true`` and ``top_logprobs:
k``; completions: ``logprobs: k``) keeps every branch's log-probabilities while it
runs (``Request.keep_logprobs``) and is answered with the chosen branch's
(``RequestResult.logprobs``), in ``vllm serve``'s (0.32) shapes:

- chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}``, ``top_logprobs`` the first ``k`` of vLLM's per-token list: the
  sampled token, then the most likely ones (so the sampled token is always there);
- completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``,
  ``top_logprobs`` a ``{text: logprob}`` object of the sampled token and the ``k``
  most likely (two tokens of one text share a key, as in vLLM's).

vLLM's ``return_tokens_as_token_ids: true`` names every token ``token_id:N`` instead
(no two share a key); a completion's then needs no tokenizer.

A token's text is the tokenizer's ``decode`` of its id alone, as vLLM names it:
with the leading spaces a SentencePiece (``Metaspace``) tokenizer's ``decode``
strips put back, and a token that ends in half a UTF-8 character (byte fallback)
decoded with the sampled tokens before it, its text what it completes (``""``
while the character is still incomplete). Values below ``-9999`` are sent as
``-9999.0``, as OpenAI and vLLM send them (JSON has no ``-inf``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sart.errors import ConfigError
from sart.messages import TokenLogprobs

#: What OpenAI (and vLLM) send for a log-probability of ``-inf``.
FLOOR = -9999.0
#: How many sampled tokens before one ending in half a character may complete it.
CONTEXT = 4
REPLACEMENT = "\ufffd"


class TokenNames:
    """Token ids to their text, as a response's ``logprobs`` name them (see the module
    docstring), cached per id: an answer names the same few thousand tokens often."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._marker = _leading_space_marker(tokenizer)
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def alone(self, token_id: int) -> str:
        """The token's text decoded alone (``REPLACEMENT`` at its end: half a character)."""
        text = self._cache.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id]) or "")
            if self._marker is not None:
                raw = self.tokenizer.convert_ids_to_tokens(token_id) or ""
                markers = len(raw) - len(raw.lstrip(self._marker))
                missing = markers - (len(text) - len(text.lstrip(" ")))
                text = " " * max(missing, 0) + text
            self._cache[token_id] = text
        return text

    def with_bytes(self, token_id: int, context: Sequence[int]) -> tuple[str, list[int]]:
        """``at``, and its UTF-8 bytes (as a chat entry's ``bytes``: one list per id,
        shared by the entries that name it alone)."""
        utf8 = self._bytes.get(token_id)
        if utf8 is not None:
            return self._cache[token_id], utf8
        text = self.at(token_id, context)
        utf8 = list(text.encode("utf-8", errors="replace"))
        if text == self.alone(token_id):
            self._bytes[token_id] = utf8
        return text, utf8

    def at(self, token_id: int, context: Sequence[int]) -> str:
        """The token's text after the sampled tokens ``context`` (oldest first)."""
        text = self.alone(token_id)
        if not text.endswith(REPLACEMENT):
            return text
        for size in range(1, min(len(context), CONTEXT) + 1):
            window = list(context[-size:])
            whole = str(self.tokenizer.decode([*window, token_id]))
            if whole.endswith(REPLACEMENT):
                continue
            # Context tokens that were half a character themselves were named "": their
            # bytes are this token's text.
            clean = len(window)
            while clean and self.alone(window[clean - 1]).endswith(REPLACEMENT):
                clean -= 1
            before = str(self.tokenizer.decode(window[:clean])) if clean else ""
            return whole[len(before) :] if whole.startswith(before) else whole
        return ""


def _leading_space_marker(tokenizer: Any) -> str | None:
    """The ``Metaspace`` replacement character of a fast tokenizer's pre-tokenizer, whose
    leading instances ``decode`` strips from a lone token (``None``: other tokenizers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        config = json.loads(backend.to_str())
    except Exception:  # a tokenizer that cannot say: decode's text as it is
        return None
    pre = config.get("pre_tokenizer") or {}
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if isinstance(step, dict) and step.get("type") == "Metaspace":
            marker = step.get("replacement")
            return marker if isinstance(marker, str) and marker else None
    return None


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def _entries(token: TokenLogprobs) -> list[tuple[int, float]]:
    """vLLM's per-token list: the sampled token, then the most likely ones (once each)."""
    assert token.token_id is not None
    entries = {token.token_id: token.logprob}
    for token_id, value in zip(token.top_ids, token.top, strict=True):
        entries.setdefault(token_id, value)
    return list(entries.items())


def placeholder(token_id: int) -> str:
    """A token as ``return_tokens_as_token_ids`` names it: ``token_id:N``, vLLM's."""
    return f"token_id:{token_id}"


def _named(
    names: TokenNames, context: Sequence[int], token_id: int, value: float, as_ids: bool
) -> dict:
    """One of a token's ``top_logprobs`` as chat names it (vLLM's key order)."""
    if as_ids:
        text = placeholder(token_id)
        return {"token": text, "logprob": _value(value), "bytes": list(text.encode())}
    text, utf8 = names.with_bytes(token_id, context)
    return {"token": text, "logprob": _value(value), "bytes": utf8}


def chat_logprobs(
    names: TokenNames,
    tokens: Sequence[TokenLogprobs],
    k: int,
    as_ids: bool = False,
    before: Sequence[int] = (),
) -> dict[str, list[dict[str, Any]]]:
    """A chat choice's ``logprobs``: each token, and the first ``k`` of its list
    (``as_ids``: tokens named ``token_id:N``; a sampled token's ``bytes`` are still its
    text's, as vLLM sends them; ``before``: the ids of the answer's tokens before these,
    a stream's earlier chunks')."""
    content: list[dict[str, Any]] = []
    context: list[int] = list(before)
    for token in tokens:
        entries = _entries(token)
        sampled, value = entries[0]
        text, utf8 = names.with_bytes(sampled, context)
        top = [_named(names, context, tid, v, as_ids) for tid, v in entries[:k]]
        name = placeholder(sampled) if as_ids else text
        content.append(
            {"token": name, "logprob": _value(value), "bytes": utf8, "top_logprobs": top}
        )
        context.append(sampled)
    return {"content": content}


def completion_logprobs(
    names: TokenNames | None,
    tokens: Sequence[TokenLogprobs],
    k: int,
    offset: int = 0,
    as_ids: bool = False,
    before: Sequence[int] = (),
) -> dict[str, list[Any]]:
    """A completion choice's ``logprobs``: the tokens' texts and values, each token's
    ``{text: logprob}`` of itself and the ``k`` most likely, and where each token's text
    starts in the choice's text (from ``offset``); ``as_ids``: each token named
    ``token_id:N`` (then ``names`` may be ``None``), its offsets counted in those, as
    vLLM counts them; ``before``: as ``chat_logprobs``'."""
    texts: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    context: list[int] = list(before)

    def name(token_id: int) -> str:
        if as_ids or names is None:
            return placeholder(token_id)
        return names.at(token_id, context)

    for token in tokens:
        entries = _entries(token)
        text = name(entries[0][0])
        offsets.append(offset)
        offset += len(text)
        texts.append(text)
        values.append(_value(token.logprob))
        tops.append({name(tid): _value(value) for tid, value in entries[: k + 1]})
        context.append(entries[0][0])
    return {"text_offset": offsets, "token_logprobs": values, "tokens": texts, "top_logprobs": tops}


def requested(request: Any, most: int) -> int | None:
    """The most likely tokens a request asks to be told with each token (``None``: no
    ``logprobs``), as ``vllm serve`` reads the fields: chat's ``logprobs: true`` with
    ``top_logprobs: k`` (0 by default), a completion's ``logprobs: k``; ``ConfigError``
    naming the field otherwise."""
    if hasattr(request, "top_logprobs"):  # chat
        top = request.top_logprobs
        if top not in (None, 0) and not request.logprobs:
            raise ConfigError(
                f"top_logprobs={top} needs logprobs=true (as vLLM: when using "
                "top_logprobs, logprobs must be set to true)"
            )
        k, field = ((top or 0) if request.logprobs else None), "top_logprobs"
    else:
        k, field = request.logprobs, "logprobs"
    if k is None:
        return None
    if k < 0 or k > most:
        raise ConfigError(f"{field}={k} must be in [0, {most}] (the server's --max-logprobs)")
    if request.echo:
        raise ConfigError(
            "echo=True with logprobs asks for the prompt's log-probabilities too, which "
            "sart serve does not return"
        )
    return k


def has_ids(tokens: Sequence[TokenLogprobs]) -> bool:
    """Whether every token says its id and its most likely tokens' (an engine that does
    not cannot be answered with their texts)."""
    return all(t.token_id is not None and len(t.top_ids) == len(t.top) for t in tokens)


__all__ = [
    "TokenNames",
    "chat_logprobs",
    "completion_logprobs",
    "has_ids",
    "placeholder",
    "requested",
]
