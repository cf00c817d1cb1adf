"""``POST /tokenize`` and ``POST /detokenize`` as ``vllm serve`` (0.32) has them, on the
engine's tokenizer, and the chat rendering they share with ``/v1/chat/completions``.

``/tokenize`` takes a ``prompt`` (text) or chat ``messages`` (rendered with the
model's chat template, as a chat request is) and answers ``{count, max_model_len,
tokens, token_strs}``; ``/detokenize`` takes ``tokens`` and answers ``{prompt}``.
``model``, if given, must be a served name (404 otherwise). Like vLLM's, neither is
under ``/v1``, so neither needs the API key. A server without a tokenizer (a gateway
started without ``--tokenizer``) answers 501 saying so.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from sart.serve.protocol import ChatMessage, Refused, _Strict, chat_messages_of


class TokenizeRequest(_Strict):
    """vLLM's ``TokenizeCompletionRequest`` and ``TokenizeChatRequest`` in one: exactly
    one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template holds them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
    add_special_tokens: bool,
) -> list[int]:
    """Chat messages as the prompt's token ids, vLLM's way: the template renders text,
    which is then tokenized (special tokens only where asked: the template already
    holds them). ``Refused`` where the tokenizer has no chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise Refused("this server's model has no chat template: use /v1/completions", "messages")
    text = tokenizer.apply_chat_template(
        chat_messages_of(messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **(chat_template_kwargs or {}),
    )
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    # transformers 5 may return a BatchEncoding (a mapping), 4.x a list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def no_tokenizer(what: str) -> Refused:
    return Refused(
        f"{what} needs a tokenizer, and this server has none (a gateway needs --tokenizer DIR)",
        None,
        501,
    )


def tokenize(tokenizer: Any, request: TokenizeRequest, max_model_len: int | None) -> dict:
    """The ``/tokenize`` answer (``max_model_len``: 0 where the engine does not say)."""
    if (request.prompt is None) == (request.messages is None):
        raise Refused("give either prompt or messages", "prompt")
    if tokenizer is None:
        raise no_tokenizer("/tokenize")
    if request.messages is not None:
        if not request.messages:
            raise Refused("messages must not be empty", "messages")
        ids = render_chat(
            tokenizer,
            request.messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
            add_special_tokens=bool(request.add_special_tokens),
        )
    else:
        special = True if request.add_special_tokens is None else request.add_special_tokens
        encoded = tokenizer.encode(request.prompt, add_special_tokens=special)
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": max_model_len or 0,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(tokenizer: Any, request: DetokenizeRequest) -> dict:
    """The ``/detokenize`` answer. Ids the tokenizer has no text for decode to nothing,
    as on ``vllm serve``; a 400 where the tokenizer cannot decode them at all."""
    if tokenizer is None:
        raise no_tokenizer("/detokenize")
    if any(t < 0 for t in request.tokens):
        raise Refused("tokens must be >= 0", "tokens")
    try:
        return {"prompt": str(tokenizer.decode(request.tokens))}
    except Exception as exc:  # e.g. an id past what the tokenizer can hold
        raise Refused(f"tokens cannot be decoded: {exc}", "tokens") from None


__all__ = [
    "DetokenizeRequest",
    "TokenizeRequest",
    "detokenize",
    "no_tokenizer",
    "render_chat",
    "tokenize",
]
