"""The server's request bodies (``sart.serve.protocol``): fields sart does not implement
are accepted at their neutral values and refused, naming the field, at any other."""

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
    "echo": True,
    "logprobs": 2,
    "top_logprobs": 2,
    "suffix": "end",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required",
}
BASES: dict[type, dict[str, Any]] = {
    CompletionRequest: {"model": "m", "prompt": "q"},
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "q"}]},
}


def cases() -> list[tuple[type, str]]:
    return [(model, f) for f in NEUTRAL for model in BASES if f in model.model_fields]


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
        if field == "logprobs" and value is not None:
            # A count in completions, a flag in chat: each takes its own neutral value.
            if type(value) is not (bool if model is ChatCompletionRequest else int):
                continue
        assert getattr(parse(model, body(model, field, value)), field) == value


@pytest.mark.parametrize(("model", "field"), cases())
def test_any_other_value_is_refused_naming_the_field(model: type, field: str) -> None:
    with pytest.raises(Refused, match=f"{field}=.* is not supported by sart serve") as caught:
        parse(model, body(model, field, MEANINGFUL[field]))
    assert caught.value.param == field and caught.value.status == 400
