"""The server's request bodies (``sart.serve.protocol``): fields sart does not implement
are accepted at their neutral values and refused, naming the field, at any other;
fields neither OpenAI's API nor vLLM's knows are ignored, as ``vllm serve`` ignores them;
vLLM's chat fields keep vLLM's meaning."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("pydantic")

from sart.serve.protocol import (
    NEUTRAL,
    ChatCompletionRequest,
    CompletionRequest,
    Refused,
    parse,
)

#: A value of each neutral field that asks for what sart does not do (one per field:
#: a field added to NEUTRAL without one fails ``test_every_neutral_field_is_covered``).
MEANINGFUL: dict[str, Any] = {
    "logit_bias": {"5": 1.0},
    "use_beam_search": True,
    "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 10,
    "allowed_token_ids": [1, 2],
    "prompt_logprobs": 1,
    "bad_words": ["x"],
    "suffix": "end",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required",
    "chat_template": "{{ messages }}",
    "documents": [{"title": "t", "text": "x"}],
    "structured_outputs": {"choice": ["1", "2"]},
    "guided_json": {"type": "object"},
    "guided_regex": "[0-9]+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "structural_tag": "{}",
    "watermarking": {"key": 1},
    "thinking_token_budget": 100,
    "reasoning_effort": "low",
    "include_reasoning": False,
    "logprob_token_ids": [5],
    "return_token_ids": True,
    "return_token_offsets": True,
    "prompt_embeds": "AAAA",
    "repetition_detection": {"window": 8},
    "vllm_xargs": {"k": 1},
    "kv_transfer_params": {"do_remote_decode": True},
    "mm_processor_kwargs": {"x": 1},
    "media_io_kwargs": {"x": 1},
    "json_schema": '{"type": "object"}',
    "regex": "[0-9]+",
    "ebnf": "root ::= 'a'",
    "stop_regex": "[.]$",
    "no_stop_trim": True,
    "min_new_tokens": 4,
    "lora_path": "adapter",
    "custom_logit_processor": "{}",
    "custom_params": {"k": 1},
    "return_hidden_states": True,
    "session_params": {"id": "s"},
}
BASES: dict[type, dict[str, Any]] = {
    CompletionRequest: {"model": "m", "prompt": "q"},
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "q"}]},
}


def cases() -> list[tuple[type, str]]:
    """Each declared field on the endpoints that declare it; vLLM's undeclared ones
    (kept in ``model_extra``) on both."""
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    return [
        (model, f)
        for f in NEUTRAL
        for model in BASES
        if f in model.model_fields or f not in declared
    ]


def body(model: type, field: str, value: Any) -> bytes:
    if model is ChatCompletionRequest and field == "logprobs" and value is not None:
        value = bool(value)  # chat's logprobs is a flag (top_logprobs the count)
    return json.dumps({**BASES[model], field: value}).encode()


def test_every_neutral_field_is_covered() -> None:
    assert set(MEANINGFUL) == set(NEUTRAL)
    assert {f for _, f in cases()} == set(NEUTRAL)  # each is a field of some request


@pytest.mark.parametrize(("model", "field"), cases())
def test_a_neutral_value_is_accepted(model: type, field: str) -> None:
    for value in NEUTRAL[field]:
        assert getattr(parse(model, body(model, field, value)), field) == value


@pytest.mark.parametrize(("model", "field"), cases())
def test_any_other_value_is_refused_naming_the_field(model: type, field: str) -> None:
    with pytest.raises(Refused, match=f"{field}=.* is not supported by sart serve") as caught:
        parse(model, body(model, field, MEANINGFUL[field]))
    assert caught.value.param == field and caught.value.status == 400


def test_a_field_neither_api_knows_is_ignored() -> None:
    request = parse(CompletionRequest, json.dumps({"model": "m", "prompt": "q", "x_y": 1}).encode())
    assert request.prompt == "q" and request.model_extra == {"x_y": 1}


def test_only_fields_really_ignored_are_logged_as_ignored(caplog: Any) -> None:
    # Before: a completion's response_format was logged as ignored, then refused.
    sent = {"model": "m", "prompt": "q", "response_format": {"type": "json_object"}}
    with pytest.raises(Refused):
        parse(CompletionRequest, json.dumps({**sent, "zz_refused_too": 1}).encode())
    parse(CompletionRequest, json.dumps({**BASES[CompletionRequest], "zz_kept": 1}).encode())
    logged = " ".join(r.getMessage() for r in caplog.records if "ignoring" in r.getMessage())
    assert "zz_kept" in logged
    assert "response_format" not in logged and "zz_refused_too" not in logged


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        ({"continue_final_message": True, "add_generation_prompt": False}, None),
        ({"continue_final_message": True}, "cannot be used together"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "cannot be used"),
    ],
)
def test_continue_final_message_as_vllm_takes_it(
    extra: dict[str, Any], refused: str | None
) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    raw = json.dumps({"model": "m", "messages": messages, **extra}).encode()
    if refused is None:
        request = parse(ChatCompletionRequest, raw)
        assert request.continue_final_message and not request.add_generation_prompt
        return
    with pytest.raises(Refused, match=refused) as caught:
        parse(ChatCompletionRequest, raw)
    assert caught.value.param == "continue_final_message"


def test_stream_options_take_vllms_continuous_usage_stats() -> None:
    raw = {
        "model": "m",
        "prompt": "q",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    request = parse(CompletionRequest, json.dumps(raw).encode())
    assert request.stream_options.continuous_usage_stats is True
