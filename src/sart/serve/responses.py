"""The OpenAI-compatible response bodies and stream chunks ``sart serve`` sends.

Responses are OpenAI's, with the chosen branch as the only choice
(``finish_reason`` ``stop`` or ``length`` as that branch ended),
``usage.completion_tokens`` counting the tokens of *every* branch (what was
computed, as OpenAI bills ``best_of``), and a ``sart`` field: the method and
policy, the chosen branch's index and answer, each branch's status, tokens
and reward, and the queue, inference and PRM times.
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from sart.policies.equivalence import Equivalence, ExactMatch
from sart.serve.config import ServeConfig
from sart.serve.service import Outcome
from sart.types import BranchStatus


def finish_reason(outcome: Outcome) -> str:
    """OpenAI's ``finish_reason`` of the chosen branch."""
    result = outcome.result
    chosen = result.branches[result.chosen] if result.chosen is not None else None
    return "length" if chosen is not None and chosen.status is BranchStatus.TRUNCATED else "stop"


def usage(outcome: Outcome) -> dict[str, int]:
    """Prompt tokens once (the branches share them), completion tokens of every branch."""
    generated = outcome.result.generated_tokens
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": outcome.prompt_tokens + generated,
    }


def extension(method: str, outcome: Outcome) -> dict[str, Any]:
    """The ``sart`` field of a response."""
    result = outcome.result
    timings = result.timings
    return {
        "method": method,
        "policy": result.policy,
        "n": len(result.branches),
        "chosen": result.chosen,
        "answer": result.answer,
        "branches": [
            {
                "index": b.index,
                "status": b.status.name.lower(),
                "tokens": b.num_tokens,
                "reward": b.reward,
                "answer": b.answer,
            }
            for b in result.branches
        ],
        "queue_time": timings.queueing,
        "inference_time": timings.inference,
        "prm_time": result.prm_seconds,
        "prm_wait_time": result.prm_wait_seconds,
    }


def completion_body(
    rid: str, created: int, model: str, method: str, outcome: Outcome, *, chat: bool
) -> dict[str, Any]:
    text = outcome.result.text or ""
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason(outcome),
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason(outcome),
        }
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(outcome),
        "sart": extension(method, outcome),
    }


def chunk(
    rid: str,
    created: int,
    model: str,
    *,
    chat: bool,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk with one choice (or none, for the usage chunk: ``extra``
    holding ``usage`` and ``text is None``, ``finish is None``, ``role`` false)."""
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if extra:
        body.update(extra)
    return body


def usage_chunk(rid: str, created: int, model: str, outcome: Outcome, *, chat: bool) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(outcome),
    }


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, typed as vLLM types them (``RefusedError``...)."""
    phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    kind = phrase if phrase.endswith("Error") else phrase + "Error"  # InternalServerError
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def equivalence_name(equivalence: Equivalence | None) -> str:
    """How ``/v1/models`` names the server's grouping of answers: ``--equivalence``'s
    name where it has one, else the class's."""
    if equivalence is None or isinstance(equivalence, ExactMatch):
        return "exact"
    name = type(equivalence).__name__
    return "math-verify" if name == "MathVerifyEquivalence" else name


def models_body(config: ServeConfig, created: int, methods: Sequence[str]) -> dict[str, Any]:
    """``GET /v1/models``, with sart's defaults and limits under ``sart``."""
    limits = {
        "methods": list(methods),
        "method": config.method,
        "n": config.n,
        "max_n": config.max_n,
        "interval": config.interval,
        "max_tokens": config.max_tokens,
        "max_tokens_limit": config.max_tokens_limit,
        "equivalence": equivalence_name(config.equivalence),
    }
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "sart", "sart": limits}
            for name in config.models
        ],
    }
