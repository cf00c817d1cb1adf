"""The OpenAI-compatible request shapes, sart's extension fields, and what a request asks for.

Requests are pydantic models in strict mode: a wrong type, or a field of
OpenAI's or vLLM's API that sart does not implement given a value that matters
(``logit_bias``, ``chat_template``...), is a 400 naming the field, never
silently ignored. A field neither API knows is ignored, as ``vllm serve``
ignores it (its protocol models allow extra fields), so that clients written
for vLLM work unchanged; the server logs its name once. sart's own
fields sit at the top level of the body, the way vLLM takes its extensions
(``extra_body`` in the ``openai`` client puts them there):

- ``method``: a name of the method registry (``sart.methods``: ``vanilla``, ``sc``,
  ``sart``, ``sart-rebranch``, ``rebase``, ``particle`` and the rest), or a name the
  operator registered (``sart.serve.register_method``);
- ``m``, ``alpha``, ``beta``, ``interval``: the policy's fields;
- ``selector``: ``best-reward``, ``majority`` or ``weighted``.

**What ``n`` means.** sart samples ``N`` branches and answers with *one*,
the chosen branch: the semantics of OpenAI's legacy ``best_of`` ("generate
``best_of`` completions server-side and return the best"), so ``best_of`` is
the number of branches. ``n`` is the number of *choices* in OpenAI's API;
sart returns one, so ``n`` keeps that meaning and must be 1, except in a
request that names its ``method``: there ``n`` is the method's number of
branches (``extra_body={"method": "sart", "n": 8}``), which is what sart's
docs and ``sart bench`` call ``n`` (``best_of``, if also given, must agree).
A plain OpenAI client asking ``n=4`` gets a 400 saying so, rather than one
choice where it expected four. Neither given: the server's default for the
method (``--n``; always 1 for ``vanilla``).

Responses (OpenAI's, with a ``sart`` field): ``sart.serve.responses``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sart.errors import ConfigError
from sart.serve.config import ServeConfig
from sart.serve.logprobs import requested
from sart.serve.methods import PolicyFields, build_policy
from sart.types import EXTRA_SAMPLING, Prompt, SamplingSettings

logger = logging.getLogger(__name__)


class Refused(Exception):
    """A request the server refuses: HTTP ``status`` (400 unless said), a message naming
    ``param``, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


# ------------------------------------------------------------------- requests


class _Strict(BaseModel):
    # Unknown fields are kept aside (``model_extra``) and ignored, as vLLM does.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    """Send a last chunk with ``usage`` (and no choices) before ``[DONE]``."""
    continuous_usage_stats: bool | None = None
    """vLLM's: with ``include_usage``, ``usage`` on every chunk too (so far: the role
    chunk counts the prompt alone; the answer's chunks, sent when the request ends,
    count every branch's tokens)."""


class _Body(_Strict):
    """Fields both endpoints take."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None
    """vLLM's: the request's id (the ``X-Request-Id`` header, if sent, wins), which the
    answer's ``id`` carries."""
    # sart's extension fields (``extra_body``)
    method: str | None = None
    m: int | None = None
    alpha: float | None = None
    beta: int | None = None
    interval: int | None = None
    selector: str | None = None
    priority: int | None = None
    """Lower is more urgent, as vLLM's server takes it (default 0)."""
    timeout: float | None = None
    """Seconds the request may take from its arrival; past them it is cancelled (its
    branches aborted) and answered 504."""
    # OpenAI's penalties and vLLM's extra sampling fields (``SamplingSettings``), for
    # engines that honour them (``sampling_fields``): a 400 names the engine otherwise.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Fields sart does not implement: accepted only at their neutral values.
    logit_bias: dict[str, float] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: ``logprobs`` name each token ``token_id:N``, not by its text."""


class CompletionRequest(_Body):
    """``POST /v1/completions``: one prompt, text or token ids."""

    prompt: str | list[int] = Field(min_length=1)
    echo: bool | None = None
    """vLLM's meaning: the answer's text starts with the prompt's."""
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_Body):
    """``POST /v1/chat/completions``: messages, rendered with the policy's chat template.

    vLLM's chat fields keep vLLM's meaning, so that a client that drives ``vllm
    serve`` one reasoning step at a time drives ``sart serve`` the same way: with
    ``continue_final_message`` (and ``add_generation_prompt: false``) the last
    message, the assistant's partial answer, is left open and continued;
    ``chat_template_kwargs`` go to the template (``enable_thinking``...)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    echo: bool | None = None
    """vLLM's meaning: the answer starts with the last message's content when that
    message is the assistant's (``continue_final_message``)."""


#: Fields sart does not implement -> the values that mean "not used".
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "prompt_logprobs": (None,),
    "bad_words": (None, []),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "chat_template": (None,),
    "documents": (None, []),
    # vLLM's, not declared above (any type is taken): each changes what is generated
    # or returned, and ignored, a client asking for constrained output would get free
    # text and a 200.
    "structured_outputs": (None, {}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None, []),
    "guided_grammar": (None,),
    "structural_tag": (None,),
    "watermarking": (None,),
    "thinking_token_budget": (None,),
    "reasoning_effort": (None,),
    "include_reasoning": (None, True),
    "logprob_token_ids": (None, []),
    "return_token_ids": (None, False),
    "return_token_offsets": (None, False),
    "prompt_embeds": (None,),
    "repetition_detection": (None,),
    "vllm_xargs": (None, {}),
    "kv_transfer_params": (None,),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    # SGLang's server's own (0.5.23's CompletionRequest), for the same reason.
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "stop_regex": (None, []),
    "no_stop_trim": (None, False),
    "min_new_tokens": (None, 0),
    "lora_path": (None,),
    "custom_logit_processor": (None,),
    "custom_params": (None, {}),
    "return_hidden_states": (None, False),
    "session_params": (None,),
}
"""``response_format`` is accepted as ``{"type": "text"}`` only."""

#: How a field's expected type is said when a value does not fit it.
_EXPECTED = {
    "prompt": "a string or a non-empty list of token ids",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {role, content} messages",
    "content": "a string or a list of {type: text, text} parts",
}
_TYPE_WORDS = {
    "float_type": "a number",
    "int_type": "an integer",
    "string_type": "a string",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
}


def parse_model(model: type[BaseModel], body: bytes) -> Any:
    """``body`` as ``model`` (types only), or ``Refused`` naming the first field at fault."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise Refused(*_describe(exc)) from None


def parse(model: type[_Body], body: bytes) -> Any:
    """``body`` as ``model``, or ``Refused`` naming the first field at fault."""
    request = parse_model(model, body)
    if isinstance(request, ChatCompletionRequest) and request.continue_final_message:
        if request.add_generation_prompt:
            # vLLM refuses the pair (transformers' apply_chat_template does too).
            raise Refused(
                "continue_final_message=True and add_generation_prompt=True cannot be used "
                "together: give add_generation_prompt=False to continue the last message",
                "continue_final_message",
            )
        if request.messages[-1].role != "assistant":
            raise Refused(
                "continue_final_message=True continues the last message, which must be the "
                f"assistant's, not the {request.messages[-1].role}'s",
                "continue_final_message",
            )
    for field, neutral in NEUTRAL.items():
        value = getattr(request, field, None)  # undeclared: from model_extra, if given
        if value not in neutral:
            raise Refused(f"{field}={_short(value)} is not supported by sart serve", field)
    response_format = getattr(request, "response_format", None)
    if response_format not in (None, {"type": "text"}):
        raise Refused(
            f"response_format={_short(response_format)} is not supported by sart serve "
            "(only {'type': 'text'})",
            "response_format",
        )
    _log_ignored(request)
    return request


_logged: set[str] = set()


def _log_ignored(request: _Body) -> None:
    """Log, once per name, the fields of a request that neither API knows (ignored)."""
    names = set(request.model_extra or ()) - NEUTRAL.keys() - {"response_format"}
    if request.stream_options is not None:
        names.update(f"stream_options.{n}" for n in request.stream_options.model_extra or ())
    for message in getattr(request, "messages", None) or ():
        names.update(f"messages.{name}" for name in message.model_extra or ())
    new = sorted(names - _logged)
    if new:
        _logged.update(new)
        logger.warning("ignoring request fields sart serve does not know: %s", ", ".join(new))


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "json_invalid":
        return f"the body is not valid JSON: {first['msg']}", None
    if not loc:
        return "the body must be a JSON object", None
    param = loc[0]
    # The field's path without pydantic's union tags ('str', 'list[int]').
    path = [p for p in loc if p.isdigit() or p.isidentifier()]
    path = [p for p in path if p not in ("str", "int", "float", "bool")]
    where = ".".join(path)
    kind = first["type"]
    if kind == "missing":
        return f"{where} is required", param
    value = _short(first.get("input"))
    leaf = next((p for p in reversed(path) if not p.isdigit()), param)
    union = len({tuple(e["loc"][:1]) for e in errors}) == 1 and len(errors) > 1
    if leaf in _EXPECTED and (union or kind in _TYPE_WORDS):
        return f"{where}={value} must be {_EXPECTED[leaf]}", param
    if kind in _TYPE_WORDS:
        return f"{where}={value} must be {_TYPE_WORDS[kind]}", param
    if kind == "literal_error":
        return f"{where}={value} must be {first['ctx']['expected']}", param
    return f"{where}={value}: {first['msg']}", param


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def policy_fields(request: _Body) -> PolicyFields:
    """The policy fields of a request, with ``n`` and ``best_of`` resolved (see the
    module docstring): ``best_of`` is the number of branches; ``n`` is too in a
    request that names its method (the two must then agree), and otherwise OpenAI's
    number of choices, which must be 1."""
    n, best_of = request.n, request.best_of
    if request.method is None:
        if n not in (None, 1):
            raise Refused(
                f"n={n} asks for {n} choices, and sart serve returns one (the chosen branch): "
                f"to sample {n} branches, give best_of={n}, or name the method and its n "
                f"(extra_body={{'method': 'sart', 'n': {n}}})",
                "n",
            )
        branches = best_of
    else:
        if n is not None and best_of is not None and n != best_of:
            raise Refused(
                f"n={n} and best_of={best_of} disagree: give the number of branches once", "n"
            )
        branches = n if n is not None else best_of
    return PolicyFields(
        method=request.method,
        n=branches,
        m=request.m,
        alpha=request.alpha,
        beta=request.beta,
        interval=request.interval,
        selector=request.selector,
    )


@attrs.frozen
class Plan:
    """What a valid request asks the server to run."""

    method: str
    request_kwargs: dict[str, Any]
    """``sart.Request`` arguments but ``id`` and ``prompt``."""
    stream: bool
    include_usage: bool
    continuous_usage: bool
    """``usage`` on every chunk too (``continuous_usage_stats`` with ``include_usage``,
    as vLLM reads the pair)."""


def plan(request: _Body, config: ServeConfig) -> Plan:
    """Check ``request`` against the server's models, defaults and limits, and build
    its policy and sampling settings (``Refused`` naming the field otherwise)."""
    if request.model not in config.models:
        raise Refused(
            f"model={request.model!r} is not served here (served: {list(config.models)})",
            "model",
            status=404,
        )
    max_tokens = request.max_tokens
    completion_tokens = getattr(request, "max_completion_tokens", None)
    if completion_tokens is not None:
        max_tokens = completion_tokens
    field = "max_completion_tokens" if completion_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = config.max_tokens
    elif max_tokens > config.max_tokens_limit:
        raise Refused(
            f"{field}={max_tokens} must be <= {config.max_tokens_limit} (the server's "
            "--max-tokens-limit)",
            field,
        )
    fields = policy_fields(request)
    if fields.n is not None and fields.n > config.max_n:
        name = "best_of" if request.best_of is not None else "n"
        raise Refused(f"{name}={fields.n} must be <= {config.max_n} (the server's --max-n)", name)
    stop = request.stop
    try:
        logprobs = requested(request, config.max_logprobs)
        method, policy = build_policy(
            fields,
            method=config.method,
            n=config.n,
            max_n=config.max_n,
            interval=config.interval,
            scoring=config.scoring,
            equivalence=config.equivalence,
        )
        sampling = SamplingSettings(
            temperature=config.temperature if request.temperature is None else request.temperature,
            top_p=config.top_p if request.top_p is None else request.top_p,
            max_tokens=max_tokens,
            seed=request.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            logprobs=logprobs,
            **{
                **config.sampling,  # the model's defaults (its generation_config.json)
                **{
                    field: value
                    for field in EXTRA_SAMPLING
                    if (value := getattr(request, field)) is not None
                },
            },
        )
    except ConfigError as exc:
        raise Refused(str(exc), field_of(str(exc))) from None
    options = request.stream_options
    if options is not None and not request.stream:
        raise Refused("stream_options is only allowed with stream=true", "stream_options")
    return Plan(
        method=method,
        request_kwargs={
            "policy": policy,
            "sampling": sampling,
            "priority": request.priority or 0,
            "timeout": request.timeout,
            "keep_logprobs": logprobs is not None,
        },
        stream=bool(request.stream),
        include_usage=bool(options is not None and options.include_usage),
        continuous_usage=bool(
            options is not None and options.include_usage and options.continuous_usage_stats
        ),
    )


def field_of(message: str) -> str | None:
    """The field a ``ConfigError`` message starts with (``"m=9 must be <= n=8"`` -> m)."""
    head = message.split("=", 1)[0]
    return head if head.isidentifier() else None


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as a chat template reads them (text parts joined)."""
    return chat_messages_of(request.messages)


def chat_messages_of(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """``messages`` as a chat template reads them (text parts joined)."""
    out = []
    for message in messages:
        content = message.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        out.append({"role": message.role, "content": content})
    return out


def question(request: ChatCompletionRequest) -> str:
    """What a PRM reads as the question of a chat: the last user message."""
    users = [m for m in chat_messages(request) if m["role"] == "user"]
    return users[-1]["content"] if users else chat_messages(request)[-1]["content"]


def chat_echo(request: ChatCompletionRequest) -> str:
    """What ``echo`` puts before a chat answer, as vLLM: the last message's content if
    it is the assistant's (text parts joined by newlines), else nothing."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant":
        return ""
    content = last.content
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def completion_prompt(request: CompletionRequest) -> Prompt:
    prompt = request.prompt
    if isinstance(prompt, list):
        if any(t < 0 for t in prompt):
            raise Refused("prompt token ids must be >= 0", "prompt")
        return tuple(prompt)
    return prompt


# ------------------------------------------------------------------- responses
